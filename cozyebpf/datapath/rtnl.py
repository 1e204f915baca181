"""The things the agent reads from rtnetlink, without pyroute2.

pyroute2 costs the agent's process about 11 MB once imported, for the rest of its life, and
the agent only needs to *read* four things on its common path: which XDP program a device has
(at attach and at every attachment check), our legacy clsact filters (to clean them up when tcx
is used), the devices of the default route (`--devices auto`) and the node's own addresses
(which no LB IP may take), followed as they change (`address_events`), and that the routes
changed (`route_events`: the programs' cached FIB answers are then asked again). These are
plain rtnetlink requests, as are the uplinks' qdiscs (`qdiscs`, `qdisc_events`: egress limits
are shaped where they are fq); pyroute2 stays for what changes the kernel's tc state (legacy clsact
filters, on kernels without tcx), and is imported only there. tests/datapath/test_rtnl.py
compares every answer with pyroute2's.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

NETLINK_ROUTE = 0
NLM_F_REQUEST = 0x1
NLM_F_DUMP = 0x300
NLMSG_ERROR = 2
NLMSG_DONE = 3
RTM_NEWLINK, RTM_GETLINK = 16, 18
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_GETROUTE = 24, 26
RTM_NEWQDISC, RTM_GETQDISC = 36, 38
RTM_NEWTFILTER, RTM_GETTFILTER = 44, 46
IFLA_XDP = 43
IFLA_XDP_ATTACHED = 2
IFLA_XDP_PROG_ID = 4
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_BPF_NAME, TCA_BPF_ID = 7, 11  # include/uapi/linux/pkt_cls.h
RTA_OIF, RTA_MULTIPATH, RTA_TABLE = 4, 9, 15
IFA_ADDRESS, IFA_LOCAL = 1, 2
RTMGRP_LINK, RTMGRP_TC, RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR = 0x1, 0x8, 0x10, 0x100
TC_H_ROOT = 0xFFFFFFFF
RTMGRP_IPV4_ROUTE, RTMGRP_IPV4_RULE = 0x40, 0x80
RTNLGRP_NEXTHOP = 32  # beyond the bind mask: NETLINK_ADD_MEMBERSHIP
SOL_NETLINK, NETLINK_ADD_MEMBERSHIP = 270, 1
RT_TABLE_MAIN = 254
NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED and NLA_F_NET_BYTEORDER

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
_IFADDRMSG = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, proto, scope, type
_RTATTR = struct.Struct("=HH")  # len, type
_RTNEXTHOP = struct.Struct("=HBBi")  # len, flags, hops, ifindex


log = logging.getLogger(__name__)


class NetlinkError(OSError):
    """The kernel answered a request with an error."""


def _align(n: int) -> int:
    return (n + 3) & ~3


def attrs(data: bytes, off: int = 0, end: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each attribute in data[off:end]."""
    end = len(data) if end is None else end
    while off + _RTATTR.size <= end:
        length, kind = _RTATTR.unpack_from(data, off)
        if length < _RTATTR.size or off + length > end:
            return
        yield kind & NLA_TYPE_MASK, data[off + _RTATTR.size : off + length]
        off += _align(length)


def request(msg_type: int, body: bytes, dump: bool) -> Iterator[tuple[int, bytes]]:
    """Send one request in this network namespace; (type, payload) of each answer."""
    flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else 0)
    with socket.socket(
        socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE
    ) as s:
        s.bind((0, 0))
        seq = 1
        s.sendto(_NLMSGHDR.pack(_NLMSGHDR.size + len(body), msg_type, flags, seq, 0) + body, (0, 0))
        while True:
            data = s.recv(1 << 16)
            off = 0
            while off + _NLMSGHDR.size <= len(data):
                length, kind, _flags, rseq, _pid = _NLMSGHDR.unpack_from(data, off)
                if length < _NLMSGHDR.size:
                    return
                payload = data[off + _NLMSGHDR.size : off + length]
                off += _align(length)
                if rseq != seq:
                    continue
                if kind == NLMSG_DONE:
                    return
                if kind == NLMSG_ERROR:
                    (err,) = struct.unpack_from("=i", payload)
                    if err:
                        raise NetlinkError(-err, os.strerror(-err))
                    return  # an acknowledgement
                yield kind, payload
                if not dump:
                    return


def xdp_program(ifindex: int) -> tuple[int, int] | None:
    """(program id, how it is attached: 1 native, 2 generic, 3 offloaded, 4 several) of the
    XDP program on a device, or None."""
    body = _IFINFOMSG.pack(socket.AF_UNSPEC, 0, ifindex, 0, 0)
    for kind, payload in request(RTM_GETLINK, body, dump=False):
        if kind != RTM_NEWLINK:
            continue
        for a, value in attrs(payload, _IFINFOMSG.size):
            if a != IFLA_XDP:
                continue
            xdp = dict(attrs(value))
            prog_id = (
                struct.unpack("=I", xdp[IFLA_XDP_PROG_ID])[0] if IFLA_XDP_PROG_ID in xdp else 0
            )
            mode = xdp[IFLA_XDP_ATTACHED][0] if IFLA_XDP_ATTACHED in xdp else 0
            return (prog_id, mode) if prog_id else None
    return None


@dataclass(frozen=True)
class TcFilter:
    """A cls_bpf filter of a clsact direction."""

    prio: int
    protocol: int  # ETH_P_*, host order (3: all)
    handle: int
    name: str  # the program's name as tc was given it
    prog_id: int


def tc_filters(ifindex: int, parent: int) -> list[TcFilter]:
    """Every cls_bpf filter at `parent` (a clsact direction) of a device, in the order the
    kernel runs them (by priority; of one priority, as its list holds them: the one added last
    first); [] when it has no clsact qdisc."""
    body = _TCMSG.pack(socket.AF_UNSPEC, ifindex, 0, parent, 0)
    out: list[TcFilter] = []
    try:
        for kind, payload in request(RTM_GETTFILTER, body, dump=True):
            if kind != RTM_NEWTFILTER:
                continue
            handle, info = _TCMSG.unpack_from(payload)[2::2]
            a = dict(attrs(payload, _TCMSG.size))
            if a.get(TCA_KIND, b"").rstrip(b"\0") != b"bpf" or TCA_OPTIONS not in a:
                continue
            opts = dict(attrs(a[TCA_OPTIONS]))
            if TCA_BPF_NAME in opts:
                name = opts[TCA_BPF_NAME].rstrip(b"\0").decode(errors="replace")
                prog_id = struct.unpack("=I", opts[TCA_BPF_ID][:4])[0] if TCA_BPF_ID in opts else 0
                proto = socket.ntohs(info & 0xFFFF)
                out.append(TcFilter(info >> 16, proto, handle, name, prog_id))
    except NetlinkError:
        return []  # no clsact qdisc (EINVAL), or the device is gone
    return out


def bpf_filter_programs(ifindex: int, parent: int) -> list[tuple[int, str, int]]:
    """(priority, program name, program id) of every cls_bpf filter at `parent` (a clsact
    direction) of a device; [] when it has no clsact qdisc."""
    return [(f.prio, f.name, f.prog_id) for f in tc_filters(ifindex, parent)]


def bpf_filters(ifindex: int, parent: int) -> list[tuple[int, str]]:
    """(priority, program name) of every cls_bpf filter at `parent` (a clsact direction) of a
    device; [] when it has no clsact qdisc."""
    return [(prio, name) for prio, name, _ in bpf_filter_programs(ifindex, parent)]


@dataclass(frozen=True)
class Qdisc:
    """A qdisc of a device: its kind ("fq", "mq", "noqueue", ...), handle and parent."""

    kind: str
    handle: int
    parent: int


def qdiscs(ifindex: int) -> list[Qdisc]:
    """Every qdisc of a device (the root first as the kernel dumps them); [] when the device
    is gone."""
    body = _TCMSG.pack(socket.AF_UNSPEC, ifindex, 0, 0, 0)
    out: list[Qdisc] = []
    try:
        for kind, payload in request(RTM_GETQDISC, body, dump=True):
            if kind != RTM_NEWQDISC:
                continue
            _fam, index, handle, parent, _info = _TCMSG.unpack_from(payload)
            a = dict(attrs(payload, _TCMSG.size))
            if index == ifindex and TCA_KIND in a:
                name = a[TCA_KIND].rstrip(b"\0").decode(errors="replace")
                out.append(Qdisc(name, handle, parent))
    except NetlinkError:
        return []
    return out


def qdisc_events() -> socket.socket:
    """A netlink socket that receives a message whenever a qdisc, class or filter of a device
    of this network namespace changes; the caller reads and closes it."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
    s.bind((0, RTMGRP_TC))
    return s


def default_route_devices() -> list[int]:
    """The output devices (ifindexes) of the main table's default IPv4 routes, every next hop
    of a multipath route included, in order."""
    body = _RTMSG.pack(socket.AF_INET, 0, 0, 0, 0, 0, 0, 0, 0)
    out: list[int] = []
    for kind, payload in request(RTM_GETROUTE, body, dump=True):
        if kind != RTM_NEWROUTE:
            continue
        family, dst_len, _src, _tos, table = _RTMSG.unpack_from(payload)[:5]
        a = dict(attrs(payload, _RTMSG.size))
        if RTA_TABLE in a:
            table = struct.unpack("=I", a[RTA_TABLE])[0]
        if family != socket.AF_INET or dst_len != 0 or table != RT_TABLE_MAIN:
            continue
        oifs = [struct.unpack("=I", a[RTA_OIF])[0]] if RTA_OIF in a else []
        mp = a.get(RTA_MULTIPATH, b"")
        off = 0
        while off + _RTNEXTHOP.size <= len(mp):
            length, _f, _h, ifindex = _RTNEXTHOP.unpack_from(mp, off)
            if length < _RTNEXTHOP.size:
                break
            oifs.append(ifindex)
            off += _align(length)
        out += [i for i in oifs if i and i not in out]
    return out


def addresses() -> list[tuple[str, int]]:
    """Every address of every device in this network namespace, as (address text, ifindex):
    IPv4's IFA_LOCAL (IFA_ADDRESS is the peer of a point-to-point link), IPv6's IFA_ADDRESS."""
    out: list[tuple[str, int]] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        body = _IFADDRMSG.pack(family, 0, 0, 0, 0)
        for kind, payload in request(RTM_GETADDR, body, dump=True):
            if kind != RTM_NEWADDR:
                continue
            fam, _plen, _flags, _scope, index = _IFADDRMSG.unpack_from(payload)
            a = dict(attrs(payload, _IFADDRMSG.size))
            raw = a.get(IFA_LOCAL, a.get(IFA_ADDRESS))
            if raw is not None and fam == family:
                out.append((socket.inet_ntop(family, raw), index))
    return out


def address_events() -> socket.socket:
    """A netlink socket that receives a message whenever an address is added to or removed
    from a device of this network namespace (both families); the caller reads and closes it."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
    s.bind((0, RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR))
    return s


def route_events() -> socket.socket:
    """A netlink socket that receives a message whenever an IPv4 route, rule or nexthop object,
    or a device (its state, its MTU), changes in this network namespace; an address's change
    comes as its local routes' change. The caller reads and closes it."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_ROUTE)
    s.bind((0, RTMGRP_LINK | RTMGRP_IPV4_ROUTE | RTMGRP_IPV4_RULE))
    s.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, RTNLGRP_NEXTHOP)
    return s


class Follow:
    """Calls `changed()` from a thread of its own after each burst of notifications on the
    netlink socket `events` (made before the caller's first read, so that no change is missed),
    and once when notifications were lost (ENOBUFS): the caller reads again what it follows.
    `stop()` ends the thread and closes the socket."""

    def __init__(self, events: socket.socket, changed: Callable[[], object], name: str) -> None:
        self.events, self.changed, self.name = events, changed, name
        self._stop_r, self._stop_w = socket.socketpair()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        for s in (self.events, self._stop_r, self._stop_w):
            s.close()

    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self.events, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                while True:  # drain what queued up: one call covers them all
                    self.events.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
            except OSError as e:  # ENOBUFS: notifications were lost; the call covers them
                log.debug("%s: %s", self.name, e)
            self.changed()
