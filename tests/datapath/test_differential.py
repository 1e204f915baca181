"""Differential tests: the loaded BPF programs against the reference model
(tests/support/refmodel.py).

Each hypothesis example is one map state and a batch of frames (valid, edge-case and
malformed). The maps are cleared and seeded from the state, then every frame runs through the
programs with BPF_PROG_RUN (ingress frames through both the XDP and the tc ingress program,
egress frames through the tc egress program) and the verdict, the output bytes and the counter
increments must equal the model's. The model's flow and fragment records are applied as the
frames go; at the end of the batch the kernel's flow and fragment tables must equal the
model's.

Frames are built with struct (scapy is far too slow for this volume) and shown with scapy when
something differs. `FEATURES` selects the classes of input that are generated. Environment:
CZ_DIFF_EXAMPLES (map states per run, default 2000), CZ_DIFF_FEATURES (comma-separated classes
instead of FEATURES).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv6Address, ip_network
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.inet6 import (
    ICMPv6EchoReply,
    ICMPv6EchoRequest,
    ICMPv6ND_NS,
    ICMPv6PacketTooBig,
    IPv6,
    IPv6ExtHdrDestOpt,
    IPv6ExtHdrFragment,
    IPv6ExtHdrHopByHop,
)
from scapy.layers.l2 import GRE, Dot1AD, Dot1Q, Ether
from scapy.packet import Packet, Raw

from cozyebpf.datapath import bpfsys, layout, loader
from cozyebpf.datapath.layout import FLOW4, FLOW6, FRAG4, FRAG6, MapSpec
from cozyebpf.datapath.maps import Flow, PinnedMaps, possible_cpus
from cozyebpf.datapath.reasons import EVENT_REASONS, REASONS, SVC_DROP_REASONS
from cozyebpf.state import AllowedPort, MapState, PodEntry, Proto, ServiceEntry, diff
from tests.support import refmodel as rm
from tests.support.packets import (
    CLIENT,
    LB_FILT,
    LB_ICMP,
    LB_WHOLE,
    MAC_A,
    MAC_B,
    OTHER_CLIENT,
    POD_FILT,
    POD_ICMP,
    POD_WHOLE,
    assert_frame,
)
from tests.support.refmodel import (
    ALLOW_ICMP,
    PORT_FILTER,
    Addr,
    AllowKey,
    FlowKey,
    FlowVal,
    Frag,
    FragKey,
    Net,
    Pod,
    RefState,
    Result,
    Svc,
)

T = TypeVar("T")

#: The classes of input generated: all of them, the programs and the model agree on each.
FEATURES: frozenset[str] = frozenset(
    {
        "ipv4",  # IPv4 TCP/UDP/SCTP/ICMP/GRE/ESP/other, options, TTL, checksums, padding
        "malformed",  # truncation at every boundary, IHL, lengths, version, data offset, ...
        "vlan",  # one, two and three VLAN tags
        "ipv6",  # IPv6, extension header chains, neighbour discovery
        "icmp-errors",  # ICMP errors with valid, truncated, nested and mismatched inner packets
        "fragments",  # first, middle, last and orphan fragments; the fragment table
        "cross-family-icmp",  # protocol 1 in IPv6 and 58 in IPv4: not ICMP, outside or inside
        "ipv6-ext-after-fragment",  # an extension header after the fragment header
        "ranges",  # loadBalancerSourceRanges of several lengths, none at all, both families
        "expiry",  # flows idle for longer than their protocol's timeout, TCP closing
    }
)
# Disabled classes, and why: none. (To narrow a run down: CZ_DIFF_FEATURES=ipv4,vlan,...)
if os.environ.get("CZ_DIFF_FEATURES"):
    FEATURES = frozenset(os.environ["CZ_DIFF_FEATURES"].split(","))

EXAMPLES = int(os.environ.get("CZ_DIFF_EXAMPLES", "2000"))  # map states per run
BATCH = (50, 60)  # frames per map state


@functools.cache
def _index(n: int) -> st.SearchStrategy[int]:
    return st.integers(0, n - 1)


def pick(draw: st.DrawFn, options: Sequence[T]) -> T:
    """One of `options`, shrinking towards the first."""
    return options[draw(_index(len(options)))]


class Choices:
    """The choices of one frame, read from bytes that hypothesis draws in one go: one byte a
    choice, so that a byte shrinking to 0 picks the first option (the simplest). One draw a
    frame instead of one a field: each draw costs tens of microseconds, and a single wide
    integer would not do, as hypothesis skews those towards small values."""

    SIZE = 64

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def pick(self, options: Sequence[T]) -> T:
        byte = self.data[self.pos] if self.pos < len(self.data) else 0
        self.pos += 1
        return options[byte % len(options)]

    def one_in(self, n: int) -> bool:
        return self.pick(range(n)) == n - 1


# -- addresses -------------------------------------------------------------------------------


def _a(text: str) -> Addr:
    return IPv6Address(text) if ":" in text else IPv4Address(text)


@dataclass(frozen=True)
class Pools:
    lbs: tuple[Addr, ...]
    pods: tuple[Addr, ...]
    remotes: tuple[Addr, ...]
    other: Addr  # nobody's


POOLS = {
    4: Pools(
        tuple(_a(f"203.0.113.{i}") for i in (1, 2, 3)),
        tuple(_a(f"10.244.0.{i}") for i in (1, 2, 3)),
        tuple(_a(f"198.51.100.{i}") for i in (1, 2)),
        _a("192.0.2.99"),
    ),
    6: Pools(
        tuple(_a(f"2001:db8:1b::{i}") for i in (1, 2, 3)),
        tuple(_a(f"fd00:10:244::{i}") for i in (1, 2, 3)),
        tuple(_a(f"2001:db8:c::{i}") for i in (1, 2)),
        _a("2001:db8:ff::99"),
    ),
}
PORTS = (53, 80, 443, 40000)  # few, so that frames meet allowed ports and flows often
ECHO_IDS = (7, 8)
FRAG_IDS = (1, 2)
GRE_PROTO, OTHER_PROTO = 47, 253
MAC = bytes.fromhex("0200000000aa") + bytes.fromhex("0200000000bb")

#: source ranges a pod may get: of several lengths, covering both, one or none of the remotes
#: (and the empty set: no source at all)
RANGE_SETS: dict[int, tuple[frozenset[Net], ...]] = {
    fam: tuple(frozenset(ip_network(n) for n in nets) for nets in sets)
    for fam, sets in (
        (
            4,
            (
                ["198.51.100.1/32"],
                ["198.51.100.0/24"],
                ["198.51.100.2/31", "192.0.2.0/24"],
                ["192.0.2.0/24"],
                [],
                ["198.51.100.1/32", "198.51.100.2/32", "10.0.0.0/8"],
            ),
        ),
        (
            6,
            (
                ["2001:db8:c::1/128"],
                ["2001:db8:c::/64"],
                ["2001:db8:c::2/127", "2001:db8:ff::/48"],
                ["2001:db8:ff::/48"],
                [],
            ),
        ),
    )
}
#: the programs' flow timeouts here (s), and the ages a seeded flow gets: fresh, idle longer
#: than the closing timeout only, idle longer than every timeout (margins of 15 s and more, so
#: that the seconds a run takes change nothing)
DIFF_TIMEOUTS = {"udp": 60, "icmp": 60, "tcp": 600, "tcp_closing": 30}
FLOW_AGES = (0, 45, 700)

# -- map states ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """An LB IP and its pod; either map entry may be missing."""

    lb: Addr
    pod: Addr
    flags: int
    in_svc: bool = True
    in_pod: bool = True


@dataclass(frozen=True)
class Seed:
    """A generated map state; frag entries carry whether they have expired."""

    pairs: tuple[Pair, ...]
    allow: tuple[AllowKey, ...] = ()
    flows: tuple[FlowKey, ...] = ()
    frags: tuple[tuple[FragKey, bool, bool], ...] = ()  # key, passed, expired
    ranges: tuple[tuple[Addr, frozenset[Net]], ...] = ()  # restricted pods
    flow_ages: tuple[tuple[FlowKey, int, bool], ...] = ()  # key, age (s), closing

    @functools.cached_property
    def maps(self) -> RefState:
        """The maps, for looking addresses up while frames are generated."""
        return self.state(0)

    def state(self, now_ns: int) -> RefState:
        """The maps; fragment entries are 1 s old, or 60 s (expired) at `now_ns`."""
        state = RefState(allow=set(self.allow), flow=set(self.flows), ranges=dict(self.ranges))
        state.timeouts = {k: v * 1_000_000_000 for k, v in DIFF_TIMEOUTS.items()}
        for key, age, closing in self.flow_ages:
            state.flow_val[key] = FlowVal(max(0, now_ns - age * 1_000_000_000), closing)
        for p in self.pairs:
            if p.in_svc:
                state.svc[p.lb] = Svc(p.pod, p.flags)
            if p.in_pod:
                state.pod[p.pod] = Pod(p.lb, p.flags)
        for key, passed, expired in self.frags:
            age = 60 if expired else 1
            state.frag[key] = Frag(max(0, now_ns - age * 1_000_000_000), passed)
        return state


def families() -> tuple[int, ...]:
    return (4, 6) if "ipv6" in FEATURES else (4,)


@st.composite
def seeds(draw: st.DrawFn) -> Seed:
    pairs: list[Pair] = []
    for fam in families():
        pool = POOLS[fam]
        for i in range(1 + draw(_index(len(pool.lbs)))):
            flags = pick(draw, (0, PORT_FILTER, PORT_FILTER | ALLOW_ICMP, ALLOW_ICMP))
            where = pick(draw, ("both", "both", "both", "svc", "pod"))
            # the pod of pair i is pods[i], or (rarely) another pair's pod
            pod = pool.pods[pick(draw, (i, i, i, (i + 1) % len(pool.pods)))]
            pairs.append(Pair(pool.lbs[i], pod, flags, where != "pod", where != "svc"))
    pods = [p.pod for p in pairs]
    allow = [
        AllowKey(pick(draw, pods), pick(draw, rm.PORT_PROTOS), pick(draw, PORTS))
        for _ in range(draw(_index(5)))
    ]
    if pick(draw, (False, False, False, True)):
        # a pod with more allowed ports than an addr value holds inline (8): the first 8
        # (sorted) inline, all of them in allow4/allow6, the programs look there too
        many = pick(draw, pods)
        skip = draw(_index(3))
        combos = [(proto, port) for proto in rm.PORT_PROTOS for port in PORTS]
        allow += [AllowKey(many, proto, port) for proto, port in combos[skip:]]
    flows: list[FlowKey] = []
    for _ in range(draw(_index(6))):
        pod = pick(draw, pods)
        remote = pick(draw, POOLS[pod.version].remotes)
        if pick(draw, (False, True)):
            proto = pick(draw, rm.PORT_PROTOS)
            ports = pick(draw, PORTS), pick(draw, PORTS)
            flows.append(FlowKey(pod, remote, ports[0], ports[1], proto))
        else:
            ident = pick(draw, ECHO_IDS)
            flows.append(FlowKey(pod, remote, ident, 0, rm.icmp_proto(pod.version)))
    ages: list[tuple[FlowKey, int, bool]] = []
    if "expiry" in FEATURES:
        for f in flows:
            closing = f.proto == rm.TCP and pick(draw, (False, True))
            ages.append((f, pick(draw, FLOW_AGES), closing))
    ranges: dict[Addr, frozenset[Net]] = {}
    if "ranges" in FEATURES:
        for pod in sorted(set(pods), key=lambda a: (a.version, int(a))):
            if pick(draw, (False, True)):
                ranges[pod] = pick(draw, RANGE_SETS[pod.version])
    frags: list[tuple[FragKey, bool, bool]] = []
    if "fragments" in FEATURES:
        for _ in range(draw(_index(4))):
            pod = pick(draw, pods)
            proto = pick(draw, (rm.UDP, rm.TCP, GRE_PROTO, rm.icmp_proto(pod.version)))
            remote = pick(draw, POOLS[pod.version].remotes)
            key = FragKey(remote, pod, pick(draw, FRAG_IDS), proto)
            frags.append((key, pick(draw, (False, True)), pick(draw, (False, True))))
    return Seed(
        tuple(pairs),
        tuple(allow),
        tuple(flows),
        tuple(frags),
        tuple(ranges.items()),
        tuple(ages),
    )


# -- frames ----------------------------------------------------------------------------------


def compact_repr(obj: object) -> str:
    """A dataclass's repr showing only the fields that differ from their defaults."""
    parts = []
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            parts.append(f"{f.name}={value!r}")
    text = f"{type(obj).__name__}({', '.join(parts)})"
    return text.replace("IPv4Address", "A").replace("IPv6Address", "A")


@dataclass(frozen=True, repr=False)
class Ip:
    """An IP packet to build: the outer one, or the inner packet of an ICMP error."""

    family: int
    src: Addr
    dst: Addr
    proto: int
    sport: int = 0  # TCP/UDP/SCTP
    dport: int = 0
    icmp: tuple[int, int] = (8, 0)  # ICMP/ICMPv6 type, code
    ident: int = 0  # ICMP echo identifier
    ttl: int = 64
    options: int = 0  # IPv4 option words (NOPs)
    ext: tuple[int, ...] = ()  # IPv6 extension headers (a fragment header is added if needed)
    frag: str = ""  # "", "first", "middle", "last"
    frag_id: int = 0
    udp_len_datagram: bool = False  # first fragment: UDP length of the whole datagram
    payload: int = 0
    csum: str = "ok"  # ok | bad | zero | ffff (computes to 0) | zero-after (0 once translated)
    inner: Ip | None = None  # ICMP errors
    inner_cut: int | None = None  # keep only this many bytes of the inner packet
    ihl: int | None = None  # IPv4: override the IHL field

    __repr__ = compact_repr


@dataclass(frozen=True, repr=False)
class Frame:
    egress: bool
    ip: Ip
    vlans: tuple[int, ...] = ()
    ethertype: int | None = None  # override
    mangle: str = ""  # cut | shrink | ihl | version | length | doff | udplen
    arg: int = 0
    pad: int = 0  # bytes after the IP packet
    translated: tuple[Addr, Addr] | None = None  # csum "zero-after": (address, translated)

    __repr__ = compact_repr


def _payload(n: int, salt: int = 0) -> bytes:
    return bytes((salt + 37 * i) & 0xFF for i in range(n))


def inet_csum(data: bytes) -> int:
    """The Internet checksum of `data` (RFC 1071)."""
    if len(data) % 2:
        data += b"\0"
    s = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while s > 0xFFFF:
        s = (s & 0xFFFF) + (s >> 16)
    return int(~s & 0xFFFF)


def _pseudo(family: int, src: Addr, dst: Addr, proto: int, length: int) -> bytes:
    if family == 4:
        return src.packed + dst.packed + struct.pack("!BBH", 0, proto, length)
    return src.packed + dst.packed + struct.pack("!IxxxB", length, proto)


def _l4(ip: Ip, translated: tuple[Addr, Addr] | None) -> bytes:
    """The L4 header and payload of `ip` (for middle and last fragments: data only), with
    its checksum as `ip.csum` asks."""
    if ip.frag in ("middle", "last"):
        return _payload(max(ip.payload, 8), ip.sport)
    body = _payload(ip.payload, ip.dport)
    csum_at, pseudo = None, True
    if ip.proto == rm.TCP:
        hdr = struct.pack("!HHIIBBHHH", ip.sport, ip.dport, 1, 0, 0x50, 0x18, 512, 0, 0)
        csum_at = 16
    elif ip.proto == rm.UDP:
        length = 8 + len(body) + (64 if ip.udp_len_datagram else 0)
        hdr = struct.pack("!HHHH", ip.sport, ip.dport, length, 0)
        csum_at = 6
    elif ip.proto == rm.SCTP:
        hdr = struct.pack("!HHII", ip.sport, ip.dport, 1, 0x1234ABCD)
    elif ip.proto in (rm.ICMP, rm.ICMPV6):  # of either family: the other's looks the same
        hdr = struct.pack("!BBHHH", ip.icmp[0], ip.icmp[1], 0, ip.ident, 1)
        if ip.inner is not None:
            inner, _, _ = build_ip(ip.inner)
            body = inner[: ip.inner_cut] if ip.inner_cut is not None else inner
        csum_at, pseudo = 2, ip.proto == rm.ICMPV6 and ip.family == 6
    else:
        return body
    if csum_at is None:
        return hdr + body
    if ip.csum in ("ffff", "zero-after"):
        body = b"\0\0" + body[2:] if len(body) >= 2 else b"\0\0"

    def checksum(src: Addr, dst: Addr, data: bytes) -> int:
        ph = _pseudo(ip.family, src, dst, ip.proto, len(data)) if pseudo else b""
        return inet_csum(ph + data)

    if ip.csum in ("ffff", "zero-after"):
        # choose the first payload word so that the checksum computes to 0 (before or after
        # the translation): with word 0 the checksum is ~S, so word ~S makes the sum 0xffff
        src, dst = ip.src, ip.dst
        if ip.csum == "zero-after" and translated is not None:
            old, new = translated
            src, dst = (new if src == old else src), (new if dst == old else dst)
        word = checksum(src, dst, hdr + body)
        body = word.to_bytes(2, "big") + body[2:]
    c = checksum(ip.src, ip.dst, hdr + body)
    if ip.proto == rm.UDP and c == 0:
        c = 0xFFFF
    if ip.csum == "bad":
        c ^= 0x5A5A
    elif ip.csum == "zero":
        c = 0
    return hdr[:csum_at] + c.to_bytes(2, "big") + hdr[csum_at + 2 :] + body


def _ext_header(kind: int, nh: int) -> bytes:
    if kind == rm.AH:
        return struct.pack("!BBH", nh, 4, 0) + _payload(20, kind)  # (4 + 2) * 4 bytes
    if kind == rm.ROUTING:
        return struct.pack("!BBBB", nh, 0, 4, 0) + bytes(4)  # SRH type, no segments left
    return struct.pack("!BB", nh, 0) + b"\x01\x04" + bytes(4)  # PadN


def build_ip(ip: Ip, translated: tuple[Addr, Addr] | None = None) -> tuple[bytes, int, list[int]]:
    """The packet's bytes, the offset of its L4 header and those of its header boundaries."""
    l4 = _l4(ip, translated)
    offset = {"": 0, "first": 0, "middle": 13, "last": 26}[ip.frag]
    more = ip.frag in ("first", "middle")
    if ip.family == 4:
        opts = b"\x01" * (4 * ip.options)
        ihl = 5 + ip.options
        frag_field = (0x2000 if more else 0) | offset
        ident = ip.frag_id if ip.frag else 0x4242
        total = 4 * ihl + len(l4)
        version_ihl = 0x40 | (ip.ihl if ip.ihl is not None else ihl)
        hdr = struct.pack(
            "!BBHHHBBH", version_ihl, 0, total, ident, frag_field, ip.ttl, ip.proto, 0
        )
        hdr += ip.src.packed + ip.dst.packed + opts
        hdr = hdr[:10] + inet_csum(hdr).to_bytes(2, "big") + hdr[12:]
        bounds = [20, len(hdr), len(hdr) + 8, len(hdr) + 20, len(hdr) + 28, len(hdr) + 48]
        return hdr + l4, len(hdr), bounds
    kinds = list(ip.ext)
    if ip.frag and rm.FRAGMENT not in kinds:
        kinds.append(rm.FRAGMENT)
    nexts = [*kinds[1:], ip.proto][: len(kinds)]
    exts = b""
    bounds = [40]
    for kind, nh in zip(kinds, nexts, strict=True):
        if kind == rm.FRAGMENT:
            exts += struct.pack("!BBHI", nh, 0, offset << 3 | more, ip.frag_id)
        else:
            exts += _ext_header(kind, nh)
        bounds.append(40 + len(exts))
    first = kinds[0] if kinds else ip.proto
    hdr = struct.pack("!IHBB", 0x60000000, len(exts) + len(l4), first, ip.ttl)
    hdr += ip.src.packed + ip.dst.packed
    end = 40 + len(exts)
    bounds += [end + 8, end + 20, end + 48]
    return hdr + exts + l4, 40 + len(exts), bounds


def build(f: Frame) -> bytes:
    """The frame's bytes, mangled as `f.mangle` says."""
    ip = f.ip
    packet, l4_off, bounds = build_ip(ip, f.translated)
    ethertype = f.ethertype or (rm.ETH_IPV4 if ip.family == 4 else rm.ETH_IPV6)
    l2 = MAC
    for i, tpid in enumerate(f.vlans):
        l2 += struct.pack("!H", tpid) + struct.pack("!H", 100 + i)
    l2 += struct.pack("!H", ethertype)
    frame = bytearray(l2 + packet + _payload(f.pad, 99))
    l3 = len(l2)
    bounds = [14, *(14 + 4 * i for i in range(1, len(f.vlans) + 1))] + [l3 + b for b in bounds]
    bounds.append(l3 + len(packet))
    l4, end = l3 + l4_off, l3 + len(packet)
    m, arg = f.mangle, f.arg
    if m == "cut":  # truncate the frame at (or one byte around) a header boundary
        cut = bounds[(arg // 3) % len(bounds)] + arg % 3 - 1
        return bytes(frame[: max(14, cut)])
    if m == "shrink":  # let the IP length end at a boundary; the frame may keep the rest
        cut = max(l3, bounds[(arg // 3) % len(bounds)] + arg % 3 - 1)
        if ip.family == 4:
            struct.pack_into("!H", frame, l3 + 2, max(0, cut - l3))
            _fix_ipv4_csum(frame, l3)
        else:
            struct.pack_into("!H", frame, l3 + 4, max(0, cut - l3 - 40))
        return bytes(frame if arg % 2 else frame[: max(14, cut)])
    if m == "ihl" and ip.family == 4:
        frame[l3] = 0x40 | (0, 1, 4, 6, 15)[arg % 5]
        _fix_ipv4_csum(frame, l3)
    elif m == "version":
        frame[l3] = (frame[l3] & 0x0F) | (0, 4, 5, 6, 15)[arg % 5] << 4
    elif m == "length":
        at = l3 + (2 if ip.family == 4 else 4)
        length = struct.unpack_from("!H", frame, at)[0]
        length = (0, length - 1, length + 1, length + 8, 0xFFFF, 19)[arg % 6]
        struct.pack_into("!H", frame, at, max(0, length))
        if ip.family == 4:
            _fix_ipv4_csum(frame, l3)
    elif m == "doff" and ip.proto == rm.TCP and l4 + 13 <= end:
        frame[l4 + 12] = (0, 4, 6, 15)[arg % 4] << 4
    elif m == "udplen" and ip.proto == rm.UDP and l4 + 8 <= end:
        length = struct.unpack_from("!H", frame, l4 + 4)[0]
        struct.pack_into("!H", frame, l4 + 4, (0, 7, 8, length + 1, 0xFFFF)[arg % 5])
    return bytes(frame)


def _fix_ipv4_csum(frame: bytearray, l3: int) -> None:
    ihl = max(5, frame[l3] & 0x0F) * 4
    if l3 + ihl > len(frame):
        return
    frame[l3 + 10 : l3 + 12] = b"\0\0"
    frame[l3 + 10 : l3 + 12] = inet_csum(bytes(frame[l3 : l3 + ihl])).to_bytes(2, "big")


def _protos(family: int) -> tuple[int, ...]:
    other: tuple[int, ...] = (GRE_PROTO, rm.ESP, OTHER_PROTO)
    if "cross-family-icmp" in FEATURES:
        other += (rm.icmp_proto(10 - family),)
    if family == 6:
        other += (rm.NO_NEXT,)
    common = (rm.TCP, rm.UDP, rm.SCTP, rm.icmp_proto(family))
    return common * 3 + other


def _icmp_types(family: int) -> tuple[int, ...]:
    types: tuple[int, ...] = (0, 8, 5, 13) if family == 4 else (128, 129, 130, 133, 135, 136)
    if "icmp-errors" in FEATURES:
        types += rm.ICMP_ERRORS[family] * 2
    return types


def _v6_chains() -> tuple[tuple[int, ...], ...]:
    """IPv6 extension header chains (a fragment header is appended for fragments)."""
    chains: tuple[tuple[int, ...], ...] = (
        (),
        (),
        (rm.HOPOPT,),
        (rm.DSTOPTS, rm.ROUTING),
        (rm.AH,),
        (rm.DSTOPTS,) * 5,  # 6 with a fragment header
        (rm.HOPOPT, rm.DSTOPTS, rm.ROUTING, rm.DSTOPTS, rm.AH, rm.DSTOPTS),  # 6
        (rm.HOPOPT,) + (rm.DSTOPTS,) * 6,  # 7: too many
        (rm.FRAGMENT,),  # an atomic fragment, unless `frag` says otherwise
    )
    if "ipv6-ext-after-fragment" in FEATURES:
        chains += ((rm.HOPOPT, rm.FRAGMENT, rm.DSTOPTS),)
    return chains


VLANS = ((),) * 6 + ((0x8100,), (0x88A8, 0x8100), (0x8100,) * 2, (0x8100,) * 3)
MANGLES = ("",) * 14 + ("cut", "cut", "shrink", "ihl", "version", "length", "doff", "udplen")
INNER_CUTS = (None,) * 6 + (8, 19, 20, 27, 28, 39, 40, 47, 48)


def inner_packet(c: Choices, family: int, us: Addr, them: Addr, egress: bool, depth: int = 0) -> Ip:
    """The packet an ICMP error quotes. Ingress: the pod's packet, from `us` (usually the LB
    IP) to a remote; egress: a packet the pod received, from a remote to `us`."""
    if c.one_in(10):  # the other family: invalid
        family = 10 - family
        us, them = POOLS[family].lbs[0], POOLS[family].remotes[0]
    icmp = rm.icmp_proto(family)
    protos = (rm.UDP, rm.TCP, rm.SCTP, icmp, icmp, GRE_PROTO)
    if "cross-family-icmp" in FEATURES:
        protos += (rm.icmp_proto(10 - family),)
    proto = c.pick(protos if depth < 2 else (rm.UDP,))
    icmp_type, inner = (rm.ECHO_REQUEST[family], 0), None
    if proto == rm.icmp_proto(10 - family):  # looks like an error, is another protocol
        icmp_type = (rm.ICMP_ERRORS[family][0], 0)
    if proto == icmp and c.one_in(2):  # an error about an error
        icmp_type = (rm.ICMP_ERRORS[family][0], 0)
        inner = inner_packet(c, family, them, us, not egress, depth + 1)
    src, dst = (them, us) if egress else (us, them)
    return Ip(
        family,
        src,
        dst,
        proto,
        c.pick(PORTS),
        c.pick(PORTS),
        icmp=icmp_type,
        ident=c.pick(ECHO_IDS),
        options=c.pick((0, 0, 0, 1)) if family == 4 else 0,
        ihl=c.pick((None,) * 8 + (4, 0)) if family == 4 else None,
        payload=c.pick((0, 4, 12)),
        csum=c.pick(("ok", "ok", "ok", "bad", "zero")),
        inner=inner,
    )


def fresh_packet(c: Choices, seed: Seed, family: int, egress: bool) -> Ip:
    """A packet from or to one of the seed's addresses (or nobody's), of any protocol."""
    pool = POOLS[family]
    pairs = [p for p in seed.pairs if p.lb.version == family]
    if egress:
        us = c.pick([p.pod for p in pairs] * 3 + [pairs[0].lb, pool.other])
    else:
        us = c.pick([p.lb for p in pairs] * 2 + [pairs[0].pod, pool.other])
    them = c.pick(pool.remotes)
    src, dst = (us, them) if egress else (them, us)
    ip = Ip(
        family,
        src,
        dst,
        c.pick(_protos(family)),
        c.pick(PORTS),
        c.pick(PORTS),
        ident=c.pick(ECHO_IDS),
        ttl=c.pick((64, 64, 64, 1, 0)),
        payload=c.pick((0, 1, 2, 9, 40)),
        csum=c.pick(("ok",) * 6 + ("bad", "zero", "ffff", "zero-after")),
    )
    if family == 4:
        ip = replace(ip, options=c.pick((0, 0, 0, 1, 2)))
    else:
        ip = replace(ip, ext=c.pick(_v6_chains()))
    if ip.proto == rm.icmp_proto(family):
        icmp_type = c.pick(_icmp_types(family))
        ip = replace(ip, icmp=(icmp_type, c.pick((0, 0, 4))))
        if icmp_type in rm.ICMP_ERRORS[family]:
            # the address the inner packet names: usually ours, sometimes another
            quoted = c.pick([us] * 6 + [p.pod for p in pairs] + [p.lb for p in pairs])
            inner = inner_packet(c, family, quoted, c.pick(pool.remotes), egress)
            ip = replace(ip, inner=inner, inner_cut=c.pick(INNER_CUTS))
    return ip


def _flow_of(f: Frame, seed: Seed) -> FlowKey | None:
    """The flow an egress frame of a port-filter pod opens (as the model would record it)."""
    ip = f.ip
    pod = seed.maps.pod.get(ip.src)
    if not f.egress or pod is None or not pod.flags & PORT_FILTER:
        return None
    if ip.proto in rm.PORT_PROTOS:
        return FlowKey(ip.src, ip.dst, ip.sport, ip.dport, ip.proto)
    if ip.proto == rm.icmp_proto(ip.family) and ip.icmp[0] == rm.ECHO_REQUEST[ip.family]:
        return FlowKey(ip.src, ip.dst, ip.ident, 0, ip.proto)
    return None


def _first_fragment_of(f: Frame, seed: Seed) -> FragKey | None:
    ip = f.ip
    svc = seed.maps.svc.get(ip.dst)
    if f.egress or ip.frag != "first":
        return None
    return FragKey(ip.src, svc.pod_ip if svc else ip.dst, ip.frag_id, ip.proto)


def aimed_packet(c: Choices, ip: Ip, seed: Seed, history: Sequence[Frame]) -> Ip:
    """`ip` (ingress) aimed at the state: a reply or an ICMP error to a flow (seeded, or
    opened by an earlier frame), a packet to an allowed port, or a later fragment of a
    recorded datagram. `ip` as it is when there is nothing to aim at."""
    family = ip.family
    aim = c.pick(("reply", "reply", "allowed", "fragment"))
    targets: Sequence[FlowKey | AllowKey | FragKey]
    if aim == "reply":
        targets = [*seed.flows, *filter(None, (_flow_of(f, seed) for f in history))]
    elif aim == "allowed":
        targets = seed.allow
    else:
        targets = [k for k, _, _ in seed.frags]
        targets += [k for k in (_first_fragment_of(f, seed) for f in history) if k]
    targets = [t for t in targets if t.pod_ip.version == family]
    if not targets:
        return ip
    t = c.pick(targets)
    # to the pod's LB IP or, now and then, to the pod IP directly
    lbs = [p.lb for p in seed.pairs if p.in_svc and p.pod == t.pod_ip]
    dst = c.pick([*lbs, *lbs, t.pod_ip])
    if isinstance(t, FragKey):
        kind = c.pick(("middle", "last"))
        return replace(ip, src=t.remote_ip, dst=dst, proto=t.proto, frag=kind, frag_id=t.id)
    icmp = rm.icmp_proto(family)
    if c.one_in(3):  # an ICMP error about the pod's packet: of the flow, or from the port
        if isinstance(t, AllowKey):
            quoted = Ip(family, dst, ip.src, t.proto, t.port, ip.dport)
        elif t.proto == icmp:
            quoted = Ip(family, dst, t.remote_ip, icmp, ident=t.pod_port)
        else:
            quoted = Ip(family, dst, t.remote_ip, t.proto, t.pod_port, t.remote_port)
        error = (c.pick(rm.ICMP_ERRORS[family]), c.pick((0, 4)))
        router = c.pick(POOLS[family].remotes)
        ip = replace(ip, src=router, proto=icmp, icmp=error, inner=quoted, inner_cut=None)
        return replace(ip, dst=dst, frag="")
    if isinstance(t, AllowKey):
        return replace(ip, dst=dst, proto=t.proto, dport=t.port, frag="")
    if t.proto == icmp:
        reply = (rm.ECHO_REPLY[family], 0)
        return replace(ip, src=t.remote_ip, dst=dst, proto=icmp, icmp=reply, ident=t.pod_port)
    sport, dport = t.remote_port, t.pod_port
    return replace(ip, src=t.remote_ip, dst=dst, proto=t.proto, sport=sport, dport=dport)


def make_frame(c: Choices, seed: Seed, history: Sequence[Frame]) -> Frame:
    egress = c.pick((False, False, True))
    family = c.pick(families())
    ip = fresh_packet(c, seed, family, egress)
    if "fragments" in FEATURES and c.one_in(6):
        kind = c.pick(("first", "middle", "last"))
        ip = replace(ip, frag=kind, frag_id=c.pick(FRAG_IDS), udp_len_datagram=c.one_in(2))
    if not egress and c.one_in(2):
        ip = aimed_packet(c, ip, seed, history)
    if ip.frag and "fragments" not in FEATURES:
        ip = replace(ip, frag="")
    translated = None
    if ip.csum == "zero-after":
        maps = seed.maps
        if egress and ip.src in maps.pod:
            translated = (ip.src, maps.pod[ip.src].lb_ip)
        elif not egress and ip.dst in maps.svc:
            translated = (ip.dst, maps.svc[ip.dst].pod_ip)
    return Frame(
        egress,
        ip,
        vlans=c.pick(VLANS) if "vlan" in FEATURES else (),
        ethertype=c.pick((None,) * 40 + (0x0806, 0x0800, 0x86DD)),
        mangle=c.pick(MANGLES) if "malformed" in FEATURES else "",
        arg=c.pick(range(60)),
        pad=c.pick((0,) * 8 + (1, 6, 30)),
        translated=translated,
    )


@dataclass(frozen=True)
class Scenario:
    seed: Seed
    frames: tuple[Frame, ...]

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """How hypothesis shows a falsifying example: one frame a line."""
        lines = [f"Scenario({compact_repr(self.seed)}, frames=["]
        first = 0
        for i, f in enumerate(self.frames):  # a run of equal frames on one line
            if i + 1 < len(self.frames) and self.frames[i + 1] == f:
                continue
            where = f"{first}" if first == i else f"{first}-{i}"
            lines.append(f"  {where}: {f!r}")
            first = i + 1
        p.text("\n".join([*lines, "])"]))


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    seed = draw(seeds())
    size = Choices.SIZE
    batch = draw(
        st.lists(st.binary(min_size=size, max_size=size), min_size=BATCH[0], max_size=BATCH[1])
    )
    frames: list[Frame] = []
    for data in batch:
        frames.append(make_frame(Choices(data), seed, frames))
    return Scenario(seed, tuple(frames))


# -- the programs ------------------------------------------------------------------------------


def _be32_int(n: int) -> int:
    """The c_uint32 whose memory holds `n` in network byte order."""
    return int.from_bytes(n.to_bytes(4, "big"), sys.byteorder)


def _addr(ip: Addr) -> int | layout.Ip6:
    return layout.be32(ip) if isinstance(ip, IPv4Address) else layout.ip6(ip)


def _addr_of(v: int | layout.Ip6) -> Addr:
    return layout.ip_of(v) if isinstance(v, int) else layout.ip6_of(v)


def map_state(state: RefState) -> MapState:
    """The model's svc, pod and allow tables as the control plane's MapState (PinnedMaps
    encodes it into addr4/addr6 and allow4/allow6, as the agent does)."""
    return MapState(
        {
            lb: ServiceEntry(s.pod_ip, bool(s.flags & PORT_FILTER), bool(s.flags & ALLOW_ICMP))
            for lb, s in state.svc.items()
        },
        {
            p: PodEntry(e.lb_ip, bool(e.flags & PORT_FILTER), bool(e.flags & ALLOW_ICMP))
            for p, e in state.pod.items()
        },
        {AllowedPort(a.pod_ip, Proto(a.proto), a.port) for a in state.allow},
        dict(state.ranges),
    )


class Datapath:
    """The three loaded programs and their pinned maps: seed, run, read back."""

    RAW_MAPS = (FLOW4, FRAG4, FLOW6, FRAG6)  # the tables the programs write

    def __init__(self, maps: PinnedMaps, progs: dict[str, loader.Program]) -> None:
        self.maps = maps
        self.progs = progs
        self.fds = {name: p.fd for name, p in progs.items()}
        self.frames = 0  # checked against the model
        self.runs = 0  # program runs

    def _fd(self, spec: MapSpec) -> int:
        return self.maps.fds[spec.name]

    def clear(self) -> None:
        self.maps.apply(diff(self.maps.read_state(), MapState()))
        for spec in self.RAW_MAPS:
            for raw in bpfsys.map_keys(self._fd(spec), spec.key_size):
                bpfsys.map_delete(self._fd(spec), ctypes.create_string_buffer(raw, len(raw)))
        self.maps.forget_seen()

    def seed(self, state: RefState, now_ns: int) -> None:
        self.maps.apply(diff(MapState(), map_state(state)))
        for f in state.flow:
            v = state.flow_val.get(f, FlowVal(now_ns))
            self.maps.add_flows([Flow(*f)], v.seen_ns, v.closing)
        for k, v in state.frag.items():
            if k.pod_ip.version == 4:
                gkey: ctypes.Structure = layout.Frag4Key(
                    _addr(k.remote_ip), _addr(k.pod_ip), layout.be16(k.id), k.proto
                )
            else:
                gkey = layout.Frag6Key(
                    _addr(k.remote_ip), _addr(k.pod_ip), _be32_int(k.id), k.proto
                )
            bpfsys.map_update(
                self._fd(FRAG4 if k.pod_ip.version == 4 else FRAG6), gkey, layout.FragVal(*v)
            )

    def flows(self) -> dict[FlowKey, bool]:
        """The flows, and whether each is closing."""
        return {FlowKey(*e.flow): e.closing for e in self.maps.flow_entries()}

    def frags(self) -> dict[FragKey, bool]:
        out = {}
        for spec in (FRAG4, FRAG6):
            fd = self._fd(spec)
            for raw in bpfsys.map_keys(fd, spec.key_size):
                k: Any = spec.key.from_buffer_copy(raw)
                val = layout.FragVal()
                if not bpfsys.map_lookup(fd, k, val):
                    continue
                ident = layout.port_of(k.id) if spec is FRAG4 else _be32_int(k.id)
                key = FragKey(_addr_of(k.remote_ip), _addr_of(k.pod_ip), ident, k.proto)
                out[key] = bool(val.passed)
        return out

    def counters(self) -> dict[str, tuple[int, int]]:
        return {r: (v["packets"], v["bytes"]) for r, v in self.maps.counters().items()}

    @functools.cached_property
    def _svc0(self) -> tuple[int, ctypes.Array[ctypes.c_char], struct.Struct, int]:
        ncpu = possible_cpus()
        size = ctypes.sizeof(layout.SvcStat)
        return ncpu, ctypes.create_string_buffer(size * ncpu), struct.Struct(f"={size // 8}Q"), size

    def unnamed(self) -> tuple[int, ...]:
        """svcstats slot 0: the counters of every packet's Service here (the seeds name none);
        in_packets, in_bytes, out_packets, out_bytes, drops[]."""
        ncpu, buf, fmt, size = self._svc0
        assert bpfsys.map_lookup(self.maps.fds["svcstats"], ctypes.c_uint32(0), buf)
        raw = buf.raw
        per_cpu = [fmt.unpack_from(raw, c * size) for c in range(ncpu)]
        return tuple(sum(col) for col in zip(*per_cpu, strict=True))

    def run(self, prog: str, frame: bytes) -> tuple[int, bytes]:
        r = bpfsys.prog_test_run(self.fds[prog], frame)
        self.runs += 1
        return r.retval, r.data


PROGRAMS = {  # name -> (source, function, program type)
    "xdp": ("ingress.c", "cz_ingress", "xdp"),
    "tc-ingress": ("ingress_tc.c", "cz_ingress_tc", "sched_cls"),
    "egress": ("egress.c", "cz_egress", "sched_cls"),
}


@pytest.fixture(scope="module")
def dp(request: pytest.FixtureRequest) -> Iterator[Datapath]:
    """The programs loaded once for the module; how much they ran is reported at the end."""
    from cozyebpf.datapath.attach import detach_all
    from tests.support.env import unique_prefix

    pin_dir = f"/sys/fs/bpf/{unique_prefix('diff')}"
    maps = PinnedMaps.ensure(pin_dir)
    maps.set_flow_timeouts(**DIFF_TIMEOUTS)
    started = time.monotonic()
    try:
        progs = {name: loader.load(*spec, pin_dir) for name, spec in PROGRAMS.items()}
        d = Datapath(maps, progs)
        yield d
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if capture is not None and d.frames:
            with capture.global_and_fixture_disabled():
                print(
                    f"\ndifferential: {d.frames} frames checked against the model, {d.runs} "
                    f"program runs, in {time.monotonic() - started:.0f} s"
                )
    finally:
        maps.close()
        detach_all(pin_dir)


# -- comparing -----------------------------------------------------------------------------


def _delta(
    after: dict[str, tuple[int, int]], before: dict[str, tuple[int, int]]
) -> dict[str, tuple[int, int]]:
    out = {}
    for r in REASONS:
        a, b = after.get(r, (0, 0)), before.get(r, (0, 0))
        if a != b:
            out[r] = (a[0] - b[0], a[1] - b[1])
    return out


def scapy_command(frame: bytes) -> str:
    try:
        return str(Ether(frame).command())
    except Exception:  # scapy cannot dissect every malformed frame
        return f"Ether(bytes.fromhex('{frame.hex()}'))"


def hexdump(data: bytes, marks: set[int]) -> str:
    """16 bytes a line; bytes at `marks` are bracketed."""
    lines = []
    for off in range(0, len(data), 16):
        cells = [
            f"[{b:02x}]" if off + i in marks else f" {b:02x} "
            for i, b in enumerate(data[off : off + 16])
        ]
        lines.append(f"  {off:04x} {''.join(cells)}")
    return "\n".join(lines)


def describe_state(state: RefState) -> str:
    def fmt(xs: object) -> str:
        return repr(xs).replace("IPv4Address", "A").replace("IPv6Address", "A")

    return "\n".join(
        f"  {name}: {fmt(getattr(state, name))}"
        for name in ("svc", "pod", "allow", "flow", "frag", "ranges", "flow_val")
    )


def mismatch(
    prog: str,
    frame: bytes,
    state: RefState,
    want: Result,
    want_code: int,
    got_code: int,
    got: bytes,
    got_counts: dict[str, tuple[int, int]],
) -> str | None:
    """None when the program did what the model says, else a report of the difference."""
    if (got_code, got, got_counts) == (want_code, want.frame, want.counts):
        return None
    lines = [
        f"{prog}: the program and the model disagree",
        f"frame ({len(frame)} bytes): {scapy_command(frame)}",
        f"  hex {frame.hex()}",
        "map state (before this frame):",
        describe_state(state),
        f"verdict: expected {want_code} ({want.verdict}), got {got_code}",
    ]
    if got_counts != want.counts:
        lines.append(f"counters: expected {want.counts}, got {got_counts}")
    if got != want.frame:
        n = max(len(got), len(want.frame))
        diff = {
            i for i in range(n) if i >= len(got) or i >= len(want.frame) or got[i] != want.frame[i]
        }
        translated = sorted(
            i for i in range(min(len(frame), len(want.frame))) if frame[i] != want.frame[i]
        )
        lines += [
            f"output differs at offsets {sorted(diff)} (the model changed offsets {translated})",
            f"expected ({len(want.frame)} bytes): {scapy_command(want.frame)}",
            hexdump(want.frame, diff),
            f"got ({len(got)} bytes): {scapy_command(got)}",
            hexdump(got, diff),
        ]
    return "\n".join(lines)


def tc_can_run(frame: bytes) -> bool:
    """BPF_PROG_RUN of a tc program refuses (EINVAL) a frame whose EtherType is IPv4 or IPv6
    with fewer bytes than the IP header after the Ethernet header; the model passes those
    untouched (too short for the key address) and XDP runs them."""
    ethertype = int.from_bytes(frame[12:14], "big")
    need = {rm.ETH_IPV4: 20, rm.ETH_IPV6: 40}.get(ethertype, 0)
    return len(frame) >= 14 + need


def per_service(counts: dict[str, tuple[int, int]], egress: bool) -> tuple[int, ...]:
    """What a frame's counts add to its Service's counters (svc_stat): the packets and bytes it
    accepted in its direction, or its drops by reason; flow-table events are not packets."""
    out = [0] * (4 + layout.SVC_DROPS)
    for reason, (packets, nbytes) in counts.items():
        if reason in EVENT_REASONS:
            continue
        if reason in SVC_DROP_REASONS:
            out[4 + SVC_DROP_REASONS.index(reason)] += packets
        else:
            at = 2 if egress else 0
            out[at] += packets
            out[at + 1] += nbytes
    return tuple(out)


def check_frame(dp: Datapath, state: RefState, frame: bytes, egress: bool) -> Result:
    """Run `frame` through the program(s) of its direction; assert they match the model, and
    that the per-Service counters of the address (slot 0 here) count it once. Returns the
    model's result (not yet applied to `state`)."""
    now = time.monotonic_ns()
    dp.frames += 1
    if egress:
        want = rm.egress(state, frame, now)
        runs = [("egress", rm.tc_code(want.verdict))]
    else:
        want = rm.ingress(state, frame, now)
        runs = [("xdp", rm.xdp_code(want.verdict)), ("tc-ingress", rm.tc_code(want.verdict))]
    for prog, code in runs:
        if prog != "xdp" and not tc_can_run(frame):
            continue
        before, svc_before = dp.counters(), dp.unnamed()
        got_code, got = dp.run(prog, frame)
        problem = mismatch(
            prog, frame, state, want, code, got_code, got, _delta(dp.counters(), before)
        )
        if problem:
            pytest.fail(problem)
        svc = tuple(a - b for a, b in zip(dp.unnamed(), svc_before, strict=True))
        if svc != per_service(want.counts, egress):
            pytest.fail(
                f"{prog}: per-Service counters (in packets, bytes, out packets, bytes, drops "
                f"{SVC_DROP_REASONS}) {svc}, want {per_service(want.counts, egress)} for "
                f"{want.counts}\nframe: {scapy_command(frame)}"
            )
    return want


def check_tables(dp: Datapath, state: RefState, context: str) -> None:
    """The kernel's flow and fragment tables hold what the model's do."""
    flows, frags = dp.flows(), dp.frags()
    want_flows = {k: state.flow_val.get(k, FlowVal(0)).closing for k in state.flow}
    want_frags = {k: v.passed for k, v in state.frag.items()}
    if flows != want_flows or frags != want_frags:
        pytest.fail(
            f"{context}: the tables differ from the model's (flow -> closing)\n"
            f"flows only in the kernel: {set(flows.items()) - set(want_flows.items())}\n"
            f"flows only in the model: {set(want_flows.items()) - set(flows.items())}\n"
            f"frags in the kernel: {frags}\nfrags in the model: {want_frags}"
        )


# -- the differential test -------------------------------------------------------------------


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    print_blob=True,
    # 50 frames an example are deliberate: generation is slower and examples larger than
    # hypothesis's defaults expect
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario=scenarios())
def test_programs_match_the_model(dp: Datapath, scenario: Scenario) -> None:
    """Every frame: same verdict, output bytes and counter increments as the model."""
    dp.clear()
    now = time.monotonic_ns()
    state = scenario.seed.state(now)
    dp.seed(state, now)
    for i, f in enumerate(scenario.frames):
        frame = build(f)
        result = check_frame(dp, state, frame, f.egress)
        state.apply(result, time.monotonic_ns())
        if result.new_flows or result.frags or result.flow_vals:
            check_tables(dp, state, f"after frame {i}: {scapy_command(frame)}")
    check_tables(dp, state, "after the batch")


def test_the_run_met_source_ranges_and_expired_flows(dp: Datapath) -> None:
    """The generated states exercised what they are for: drops from outside a pod's ranges,
    and replies of flows (some expired)."""
    if not {"ranges", "expiry"} <= FEATURES or dp.frames == 0:
        pytest.skip("ranges or expiry not generated in this run")
    counts = dp.counters()
    assert counts.get("drop_source", (0, 0))[0] > 0, counts
    assert counts.get("pass_reply", (0, 0))[0] > 0, counts


# -- hand-written regression cases -------------------------------------------------------------

CLIENT6 = "2001:db8:c::100"
ROUTER, ROUTER6 = "192.0.2.1", "2001:db8:ff::1"
LB6_WHOLE, POD6_WHOLE = "2001:db8:1b::10", "fd00:10:244::10"
LB6_FILT, POD6_FILT = "2001:db8:1b::20", "fd00:10:244::20"
# a whole-IP Service whose pod accepts CLIENT only (loadBalancerSourceRanges), both families
LB_RANGED, POD_RANGED = "203.0.113.40", "10.244.1.50"
LB6_RANGED, POD6_RANGED = "2001:db8:1b::40", "fd00:10:244::40"
OTHER_CLIENT6 = "2001:db8:c::200"

REG_SEED = Seed(
    pairs=(
        Pair(_a(LB_WHOLE), _a(POD_WHOLE), 0),
        Pair(_a(LB_FILT), _a(POD_FILT), PORT_FILTER),
        Pair(_a(LB_ICMP), _a(POD_ICMP), PORT_FILTER | ALLOW_ICMP),
        Pair(_a(LB6_WHOLE), _a(POD6_WHOLE), 0),
        Pair(_a(LB6_FILT), _a(POD6_FILT), PORT_FILTER),
        Pair(_a(LB_RANGED), _a(POD_RANGED), 0),
        Pair(_a(LB6_RANGED), _a(POD6_RANGED), 0),
    ),
    allow=(
        AllowKey(_a(POD_FILT), rm.TCP, 80),
        AllowKey(_a(POD_FILT), rm.UDP, 53),
        AllowKey(_a(POD6_FILT), rm.TCP, 80),
    ),
    flows=(
        FlowKey(_a(POD_FILT), _a(CLIENT), 34000, 443, rm.TCP),
        FlowKey(_a(POD_FILT), _a(CLIENT), 77, 0, rm.ICMP),
        FlowKey(_a(POD6_FILT), _a(CLIENT6), 34000, 443, rm.TCP),
        FlowKey(_a(POD_RANGED), _a(OTHER_CLIENT), 36000, 443, rm.TCP),  # the pod's own
        FlowKey(_a(POD6_RANGED), _a(OTHER_CLIENT6), 36000, 443, rm.TCP),
        FlowKey(_a(POD_FILT), _a(CLIENT), 35053, 53, rm.UDP),  # idle too long (flow_ages)
        FlowKey(_a(POD_FILT), _a(CLIENT), 35080, 80, rm.TCP),  # closed 45 s ago
    ),
    frags=(
        (FragKey(_a(CLIENT), _a(POD_FILT), 1, rm.UDP), True, False),
        (FragKey(_a(CLIENT), _a(POD_FILT), 2, rm.UDP), False, False),
        (FragKey(_a(CLIENT), _a(POD_FILT), 3, rm.UDP), True, True),  # expired
    ),
    ranges=(
        (_a(POD_RANGED), frozenset({ip_network(f"{CLIENT}/32")})),
        (_a(POD6_RANGED), frozenset({ip_network("2001:db8:c::100/127")})),
    ),
    flow_ages=(
        (FlowKey(_a(POD_FILT), _a(CLIENT), 35053, 53, rm.UDP), 700, False),
        (FlowKey(_a(POD_FILT), _a(CLIENT), 35080, 80, rm.TCP), 45, True),
    ),
)


def eth() -> Packet:
    return Ether(src=MAC_A, dst=MAC_B)


def udp_zero_after(lb: str, pod: str) -> tuple[Packet, Packet]:
    """UDP to `lb` whose checksum computes to 0 once the destination is `pod`: it must leave
    as 0xffff. The first payload word cancels the rest of the sum."""
    probe = IP(src=CLIENT, dst=pod, id=7) / UDP(sport=1000, dport=2000) / b"\0\0zero"
    word = IP(bytes(probe))[UDP].chksum.to_bytes(2, "big")
    out = IP(src=CLIENT, dst=pod, id=7) / UDP(sport=1000, dport=2000) / (word + b"zero")
    assert IP(bytes(out))[UDP].chksum == 0xFFFF  # scapy too writes a computed 0 as 0xffff
    inp = IP(src=CLIENT, dst=lb, id=7) / UDP(sport=1000, dport=2000) / (word + b"zero")
    return eth() / inp, eth() / out


def v4(dst: str, src: str = CLIENT, **kw: Any) -> Packet:
    return eth() / IP(src=src, dst=dst, **kw)


def v6(dst: str, src: str = CLIENT6, **kw: Any) -> Packet:
    return eth() / IPv6(src=src, dst=dst, **kw)


@dataclass(frozen=True)
class Step:
    """One frame through one direction, with what must come of it."""

    frame: Packet | bytes
    reasons: tuple[str, ...]  # counted; () for a frame that is not ours
    out: Packet | bytes | None = None  # None: unchanged
    egress: bool = False

    @property
    def verdict(self) -> str:
        return rm.DROP if any(r.startswith("drop") for r in self.reasons) else rm.PASS


def case(name: str, *steps: Step) -> Any:
    return pytest.param(steps, id=name)


ZERO = udp_zero_after(LB_WHOLE, POD_WHOLE)
TCP_SYN = TCP(sport=40000, dport=80, flags="S")
TCP_REPLY = TCP(sport=443, dport=34000, flags="SA")
PADDING = b"\0" * 6
SIX_EXT = IPv6ExtHdrHopByHop() / IPv6ExtHdrDestOpt() / IPv6ExtHdrDestOpt() / IPv6ExtHdrDestOpt()
SIX_EXT = SIX_EXT / IPv6ExtHdrDestOpt() / IPv6ExtHdrDestOpt()
FRAG_DATA = Raw(b"d" * 24)


def icmp_error(outer_dst: str, inner: Packet, src: str = ROUTER, code: int = 4) -> Packet:
    return v4(outer_dst, src=src) / ICMP(type=3, code=code, nexthopmtu=1400) / inner


REGRESSIONS = [
    # source ranges (whole-IP; the pod IP is held to them too) and expiring flows
    case(
        "a source inside the ranges is translated",
        Step(v4(LB_RANGED) / TCP_SYN, ("nat_ingress",), v4(POD_RANGED) / TCP_SYN),
    ),
    case(
        "a source outside the ranges is dropped, to the LB IP and to the pod IP",
        Step(v4(LB_RANGED, src=OTHER_CLIENT) / TCP_SYN, ("drop_source",)),
        Step(v4(POD_RANGED, src=OTHER_CLIENT) / UDP(dport=53), ("drop_source",)),
        Step(v4(LB_RANGED, src=OTHER_CLIENT) / ICMP(), ("drop_source",)),
    ),
    case(
        "a reply of the pod's own flow from outside the ranges passes",
        Step(
            v4(LB_RANGED, src=OTHER_CLIENT) / TCP(sport=443, dport=36000, flags="A"),
            ("pass_reply",),
            v4(POD_RANGED, src=OTHER_CLIENT) / TCP(sport=443, dport=36000, flags="A"),
        ),
        Step(
            v6(LB6_RANGED, src=OTHER_CLIENT6) / TCP(sport=443, dport=36000, flags="A"),
            ("pass_reply",),
            v6(POD6_RANGED, src=OTHER_CLIENT6) / TCP(sport=443, dport=36000, flags="A"),
        ),
        Step(v6(LB6_RANGED, src=OTHER_CLIENT6) / TCP_SYN, ("drop_source",)),
        Step(v6(LB6_RANGED) / TCP_SYN, ("nat_ingress",), v6(POD6_RANGED) / TCP_SYN),
    ),
    case(
        "a restricted whole-IP pod's egress records its flows, and the reply then passes",
        Step(
            v4(OTHER_CLIENT, src=POD_RANGED) / UDP(sport=5353, dport=53),
            ("nat_egress", "flow_new"),
            v4(OTHER_CLIENT, src=LB_RANGED) / UDP(sport=5353, dport=53),
            egress=True,
        ),
        Step(
            v4(LB_RANGED, src=OTHER_CLIENT) / UDP(sport=53, dport=5353),
            ("pass_reply",),
            v4(POD_RANGED, src=OTHER_CLIENT) / UDP(sport=53, dport=5353),
        ),
    ),
    case(
        "replies after the idle timeout are dropped like an unlisted port",
        Step(v4(LB_FILT) / UDP(sport=53, dport=35053), ("drop_port",)),
        Step(v4(LB_FILT) / TCP(sport=80, dport=35080, flags="A"), ("drop_port",)),
    ),
    case(
        "the pod's next packet revives an expired flow; a SYN clears the closing mark",
        Step(
            v4(CLIENT, src=POD_FILT) / UDP(sport=35053, dport=53),
            ("nat_egress",),
            v4(CLIENT, src=LB_FILT) / UDP(sport=35053, dport=53),
            egress=True,
        ),
        Step(
            v4(LB_FILT) / UDP(sport=53, dport=35053),
            ("pass_reply",),
            v4(POD_FILT) / UDP(sport=53, dport=35053),
        ),
        Step(
            v4(CLIENT, src=POD_FILT) / TCP(sport=35080, dport=80, flags="S"),
            ("nat_egress",),
            v4(CLIENT, src=LB_FILT) / TCP(sport=35080, dport=80, flags="S"),
            egress=True,
        ),
        Step(
            v4(LB_FILT) / TCP(sport=80, dport=35080, flags="SA"),
            ("pass_reply",),
            v4(POD_FILT) / TCP(sport=80, dport=35080, flags="SA"),
        ),
    ),
    # Ethernet, VLAN, IPv4 header
    case(
        "padding after the IPv4 total length is kept",
        Step(
            bytes(v4(LB_WHOLE) / UDP(sport=5000, dport=7) / b"x") + PADDING,
            ("nat_ingress",),
            bytes(v4(POD_WHOLE) / UDP(sport=5000, dport=7) / b"x") + PADDING,
        ),
    ),
    case(
        "a UDP checksum of 0 stays 0",
        Step(
            v4(LB_WHOLE) / UDP(dport=9, chksum=0) / b"nocs",
            ("nat_ingress",),
            v4(POD_WHOLE) / UDP(dport=9, chksum=0) / b"nocs",
        ),
    ),
    case(
        "a UDP checksum computing to 0 is written 0xffff", Step(ZERO[0], ("nat_ingress",), ZERO[1])
    ),
    case(
        "TTL 1 is translated",
        Step(v4(LB_WHOLE, ttl=1) / TCP_SYN, ("nat_ingress",), v4(POD_WHOLE, ttl=1) / TCP_SYN),
    ),
    case(
        "TTL 0 is translated",
        Step(v4(LB_WHOLE, ttl=0) / TCP_SYN, ("nat_ingress",), v4(POD_WHOLE, ttl=0) / TCP_SYN),
    ),
    case(
        "IPv4 options are kept, the header checksum covers them",
        Step(
            v4(LB_WHOLE, options=b"\x01\x01\x01\x00") / TCP_SYN,
            ("nat_ingress",),
            v4(POD_WHOLE, options=b"\x01\x01\x01\x00") / TCP_SYN,
        ),
    ),
    case(
        "one VLAN tag: translated inside the tag",
        Step(
            eth() / Dot1Q(vlan=5) / IP(src=CLIENT, dst=LB_WHOLE) / TCP_SYN,
            ("nat_ingress",),
            eth() / Dot1Q(vlan=5) / IP(src=CLIENT, dst=POD_WHOLE) / TCP_SYN,
        ),
    ),
    case(
        "802.1ad and 802.1Q tags: translated inside the tags",
        Step(
            eth() / Dot1AD(vlan=5) / Dot1Q(vlan=6) / IP(src=CLIENT, dst=LB_WHOLE) / TCP_SYN,
            ("nat_ingress",),
            eth() / Dot1AD(vlan=5) / Dot1Q(vlan=6) / IP(src=CLIENT, dst=POD_WHOLE) / TCP_SYN,
        ),
    ),
    case(
        "three VLAN tags pass unchanged and uncounted",
        Step(eth() / Dot1Q() / Dot1Q() / Dot1Q() / IP(src=CLIENT, dst=LB_WHOLE) / TCP_SYN, ()),
    ),
    case(
        "a frame too short for the IPv4 header passes, uncounted",
        Step(bytes(v4(LB_WHOLE) / TCP_SYN)[: 14 + 19], ()),
    ),
    case("IHL 4 is malformed", Step(v4(LB_WHOLE, ihl=4) / TCP_SYN, ("drop_malformed",))),
    case(
        "IHL x 4 beyond the frame is malformed",
        Step(v4(LB_WHOLE, ihl=15) / UDP(dport=9), ("drop_malformed",)),
    ),
    case(
        "a total length below IHL x 4 is malformed",
        Step(v4(LB_WHOLE, len=19) / TCP_SYN, ("drop_malformed",)),
    ),
    case(
        "a total length beyond the frame is malformed",
        Step(v4(LB_WHOLE, len=200) / TCP_SYN, ("drop_malformed",)),
    ),
    case(
        "a truncated TCP header is malformed",
        Step(v4(LB_WHOLE, proto=6) / Raw(b"\x00\x01\x00\x02"), ("drop_malformed",)),
    ),
    case(
        "a TCP data offset of 4 is malformed",
        Step(v4(LB_WHOLE) / TCP(dport=80, dataofs=4), ("drop_malformed",)),
    ),
    case(
        "a TCP data offset beyond the IP payload is malformed",
        Step(v4(LB_WHOLE) / TCP(dport=80, dataofs=15), ("drop_malformed",)),
    ),
    case("a UDP length of 7 is malformed", Step(v4(LB_WHOLE) / UDP(len=7), ("drop_malformed",))),
    case(
        "a UDP length beyond the IP payload is malformed",
        Step(v4(LB_WHOLE) / UDP(len=100) / b"x", ("drop_malformed",)),
    ),
    case(
        "an SCTP header of 11 bytes is malformed",
        Step(v4(LB_WHOLE, proto=132) / Raw(b"\0" * 11), ("drop_malformed",)),
    ),
    case(
        "an ICMP header of 7 bytes is malformed",
        Step(v4(LB_WHOLE, proto=1) / Raw(b"\x08" + b"\0" * 6), ("drop_malformed",)),
    ),
    case("an address nobody manages passes, uncounted", Step(v4("203.0.113.99") / TCP_SYN, ())),
    case(
        "direct to the pod IP: filtered, passes untouched",
        Step(v4(POD_FILT) / TCP_SYN, ("pass_port",)),
    ),
    case(
        "whole-IP GRE is translated, its payload kept",
        Step(v4(LB_WHOLE) / GRE() / b"inner", ("nat_ingress",), v4(POD_WHOLE) / GRE() / b"inner"),
    ),
    case("port filter: GRE_PROTO has no ports", Step(v4(LB_FILT) / GRE(), ("drop_proto",))),
    # IPv6
    case(
        "whole-IP IPv6 UDP is translated",
        Step(
            v6(LB6_WHOLE) / UDP(dport=9) / b"six",
            ("nat_ingress",),
            v6(POD6_WHOLE) / UDP(dport=9) / b"six",
        ),
    ),
    case(
        "ICMPv6 echo: the checksum covers the new destination",
        Step(
            v6(LB6_WHOLE) / ICMPv6EchoRequest(id=5),
            ("nat_ingress",),
            v6(POD6_WHOLE) / ICMPv6EchoRequest(id=5),
        ),
    ),
    case(
        "IPv6 payload length 0 is malformed",
        Step(v6(LB6_WHOLE, plen=0) / UDP(dport=9), ("drop_malformed",)),
    ),
    case(
        "six IPv6 extension headers are walked",
        Step(
            v6(LB6_FILT) / SIX_EXT / TCP_SYN,
            ("pass_port",),
            v6(POD6_FILT) / SIX_EXT / TCP_SYN,
        ),
    ),
    case(
        "seven IPv6 extension headers are malformed",
        Step(v6(LB6_FILT) / SIX_EXT / IPv6ExtHdrDestOpt() / TCP_SYN, ("drop_malformed",)),
    ),
    case(
        "a truncated IPv6 extension header is malformed",
        Step(v6(LB6_WHOLE, nh=60, plen=4) / Raw(b"\x11\x00\x01\x02"), ("drop_malformed",)),
    ),
    case(
        "IPv6 no next header (59), port filter: drop_proto",
        Step(v6(LB6_FILT, nh=59) / Raw(b"x" * 8), ("drop_proto",)),
    ),
    case(
        "whole-IP IPv6 ESP is translated",
        Step(
            v6(LB6_WHOLE, nh=50) / Raw(b"e" * 16),
            ("nat_ingress",),
            v6(POD6_WHOLE, nh=50) / Raw(b"e" * 16),
        ),
    ),
    case(
        "neighbour solicitation to an LB IP passes unchanged and uncounted",
        Step(v6(LB6_FILT) / ICMPv6ND_NS(tgt=LB6_FILT), ()),
    ),
    # fragments
    case(
        "later fragment after a passed first one: pass_fragment",
        Step(
            v4(LB_FILT, id=1, proto=17, frag=10) / FRAG_DATA,
            ("pass_fragment",),
            v4(POD_FILT, id=1, proto=17, frag=10) / FRAG_DATA,
        ),
    ),
    case(
        "later fragment after a dropped first one: drop_fragment",
        Step(v4(LB_FILT, id=2, proto=17, frag=10) / FRAG_DATA, ("drop_fragment",)),
    ),
    case(
        "later fragment whose entry expired: drop_frag_orphan",
        Step(v4(LB_FILT, id=3, proto=17, frag=10) / FRAG_DATA, ("drop_frag_orphan",)),
    ),
    case(
        "later fragment without an entry: drop_frag_orphan",
        Step(v4(LB_FILT, id=9, proto=17, frag=10) / FRAG_DATA, ("drop_frag_orphan",)),
    ),
    case(
        "a first fragment to an allowed port records a pass for the fragments after it",
        Step(
            v4(LB_FILT, id=20, flags="MF") / UDP(sport=5000, dport=53, len=1000) / (b"q" * 16),
            ("pass_port",),
            v4(POD_FILT, id=20, flags="MF") / UDP(sport=5000, dport=53, len=1000) / (b"q" * 16),
        ),
        Step(
            v4(LB_FILT, id=20, proto=17, frag=3) / FRAG_DATA,
            ("pass_fragment",),
            v4(POD_FILT, id=20, proto=17, frag=3) / FRAG_DATA,
        ),
    ),
    case(
        "a first fragment to a closed port records a drop",
        Step(v4(LB_FILT, id=21, flags="MF") / UDP(dport=54) / (b"q" * 16), ("drop_port",)),
        Step(v4(LB_FILT, id=21, proto=17, frag=3) / FRAG_DATA, ("drop_fragment",)),
    ),
    case(
        "whole-IP later fragment: translated without state",
        Step(
            v4(LB_WHOLE, id=5, proto=17, frag=3) / FRAG_DATA,
            ("nat_ingress",),
            v4(POD_WHOLE, id=5, proto=17, frag=3) / FRAG_DATA,
        ),
    ),
    case(
        "IPv6 later fragment without an entry: drop_frag_orphan",
        Step(
            v6(LB6_FILT) / IPv6ExtHdrFragment(offset=5, id=7, nh=17) / FRAG_DATA,
            ("drop_frag_orphan",),
        ),
    ),
    # ICMP errors
    case(
        "frag needed about the pod's flow is related: the inner source is translated too",
        Step(
            icmp_error(LB_FILT, IP(src=LB_FILT, dst=CLIENT) / TCP(sport=34000, dport=443)),
            ("pass_related",),
            v4(POD_FILT, src=ROUTER)
            / ICMP(type=3, code=4, nexthopmtu=1400)
            / IP(src=POD_FILT, dst=CLIENT)
            / TCP(sport=34000, dport=443),
        ),
    ),
    case(
        "an error about a reply of the pod's listening port is related",
        Step(
            icmp_error(LB_FILT, IP(src=LB_FILT, dst=CLIENT) / UDP(sport=53, dport=5353)),
            ("pass_related",),
            v4(POD_FILT, src=ROUTER)
            / ICMP(type=3, code=4, nexthopmtu=1400)
            / IP(src=POD_FILT, dst=CLIENT)
            / UDP(sport=53, dport=5353),
        ),
    ),
    case(
        "an error about no flow of the pod, without allowICMP: drop_icmp",
        Step(
            icmp_error(LB_FILT, IP(src=LB_FILT, dst=CLIENT) / TCP(sport=35000, dport=443)),
            ("drop_icmp",),
        ),
    ),
    case(
        "an error about an error: drop_icmp_inner",
        Step(
            icmp_error(LB_WHOLE, IP(src=LB_WHOLE, dst=CLIENT) / ICMP(type=11) / IP() / UDP()),
            ("drop_icmp_inner",),
        ),
    ),
    case(
        "an inner packet with 7 bytes of L4 header: drop_icmp_inner",
        Step(
            icmp_error(LB_WHOLE, Raw(bytes(IP(src=LB_WHOLE, dst=CLIENT) / UDP())[:27])),
            ("drop_icmp_inner",),
        ),
    ),
    case(
        "an inner packet of the other family: drop_icmp_inner",
        Step(icmp_error(LB_WHOLE, IPv6(src=CLIENT6) / UDP()), ("drop_icmp_inner",)),
    ),
    case(
        "whole-IP error whose inner source is not the LB IP: only the outer header changes",
        Step(
            icmp_error(LB_WHOLE, IP(src=OTHER_CLIENT, dst=CLIENT) / UDP(sport=7, dport=9)),
            ("nat_ingress",),
            icmp_error(POD_WHOLE, IP(src=OTHER_CLIENT, dst=CLIENT) / UDP(sport=7, dport=9)),
        ),
    ),
    case(
        "ICMPv6 packet too big about the pod's flow is related",
        Step(
            v6(LB6_FILT, src=ROUTER6)
            / ICMPv6PacketTooBig(mtu=1280)
            / IPv6(src=LB6_FILT, dst=CLIENT6)
            / TCP(sport=34000, dport=443),
            ("pass_related",),
            v6(POD6_FILT, src=ROUTER6)
            / ICMPv6PacketTooBig(mtu=1280)
            / IPv6(src=POD6_FILT, dst=CLIENT6)
            / TCP(sport=34000, dport=443),
        ),
    ),
    case(
        "an error quoting another host's packet is not related (no allowICMP)",
        Step(
            icmp_error(LB_FILT, IP(src=OTHER_CLIENT, dst=CLIENT) / TCP(sport=34000, dport=443)),
            ("drop_icmp",),
        ),
    ),
    case(
        "an inner ICMPv6 echo request's checksum follows its translated source",
        Step(
            v6(LB6_WHOLE, src=ROUTER6)
            / ICMPv6PacketTooBig(mtu=1280)
            / IPv6(src=LB6_WHOLE, dst=CLIENT6)
            / ICMPv6EchoRequest(id=5),
            ("nat_ingress",),
            v6(POD6_WHOLE, src=ROUTER6)
            / ICMPv6PacketTooBig(mtu=1280)
            / IPv6(src=POD6_WHOLE, dst=CLIENT6)
            / ICMPv6EchoRequest(id=5),
        ),
    ),
    case(
        "a first fragment refused before the filter (invalid inner packet) records nothing",
        Step(
            v4(LB_FILT, id=22, flags="MF") / ICMP(type=3) / Raw(b"\x45" + b"\0" * 10),
            ("drop_icmp_inner",),
        ),
        Step(v4(LB_FILT, id=22, proto=1, frag=3) / FRAG_DATA, ("drop_frag_orphan",)),
    ),
    case(
        "protocol 1 in IPv6 is no ICMP: a whole-IP packet without its header is translated",
        Step(
            v6(LB6_WHOLE, nh=1) / Raw(b"\x80\x00"),
            ("nat_ingress",),
            v6(POD6_WHOLE, nh=1) / Raw(b"\x80\x00"),
        ),
    ),
    case(
        "a later IPv6 fragment's data is not walked as extension headers",
        Step(
            v6(LB6_WHOLE) / IPv6ExtHdrFragment(offset=100, id=9, nh=60) / Raw(b"\x06\xff" * 12),
            ("nat_ingress",),
            v6(POD6_WHOLE) / IPv6ExtHdrFragment(offset=100, id=9, nh=60) / Raw(b"\x06\xff" * 12),
        ),
    ),
    # egress
    case(
        "a filtered pod opens a flow: nat_egress and flow_new, once",
        Step(
            v4(CLIENT, src=POD_FILT) / TCP(sport=36000, dport=443),
            ("nat_egress", "flow_new"),
            v4(CLIENT, src=LB_FILT) / TCP(sport=36000, dport=443),
            egress=True,
        ),
        Step(
            v4(CLIENT, src=POD_FILT) / TCP(sport=36000, dport=443),
            ("nat_egress",),
            v4(CLIENT, src=LB_FILT) / TCP(sport=36000, dport=443),
            egress=True,
        ),
        Step(
            v4(LB_FILT, src=CLIENT) / TCP(sport=443, dport=36000),
            ("pass_reply",),
            v4(POD_FILT, src=CLIENT) / TCP(sport=443, dport=36000),
        ),
    ),
    case(
        "an ICMPv6 echo request records a flow of its identifier",
        Step(
            v6(CLIENT6, src=POD6_FILT) / ICMPv6EchoRequest(id=5),
            ("nat_egress", "flow_new"),
            v6(CLIENT6, src=LB6_FILT) / ICMPv6EchoRequest(id=5),
            egress=True,
        ),
        Step(
            v6(LB6_FILT) / ICMPv6EchoReply(id=5),
            ("pass_reply",),
            v6(POD6_FILT) / ICMPv6EchoReply(id=5),
        ),
    ),
    case(
        "the pod's port unreachable: the inner destination becomes the LB IP",
        Step(
            v4(CLIENT, src=POD_WHOLE)
            / ICMP(type=3, code=3)
            / IP(src=CLIENT, dst=POD_WHOLE)
            / UDP(sport=5000, dport=9),
            ("nat_egress",),
            v4(CLIENT, src=LB_WHOLE)
            / ICMP(type=3, code=3)
            / IP(src=CLIENT, dst=LB_WHOLE)
            / UDP(sport=5000, dport=9),
            egress=True,
        ),
    ),
    case(
        "egress never drops an ICMP error: an invalid inner packet, the outer header changes",
        Step(
            v4(CLIENT, src=POD_WHOLE) / ICMP(type=3, code=3) / Raw(b"\x45" + b"\0" * 10),
            ("nat_egress",),
            v4(CLIENT, src=LB_WHOLE) / ICMP(type=3, code=3) / Raw(b"\x45" + b"\0" * 10),
            egress=True,
        ),
    ),
    case(
        "egress: a malformed header is dropped",
        Step(v4(CLIENT, src=POD_WHOLE, ihl=4) / TCP_SYN, ("drop_malformed",), egress=True),
    ),
    case(
        "egress: seven IPv6 extension headers are malformed",
        Step(
            v6(CLIENT6, src=POD6_WHOLE) / SIX_EXT / IPv6ExtHdrDestOpt() / TCP_SYN,
            ("drop_malformed",),
            egress=True,
        ),
    ),
]


@pytest.mark.parametrize("steps", REGRESSIONS)
def test_regression(dp: Datapath, steps: tuple[Step, ...]) -> None:
    """The cases the spec names: the model gives the hand-written answer, and so do the
    programs (the XDP and tc ingress programs, or the egress program)."""
    dp.clear()
    now = time.monotonic_ns()
    state = REG_SEED.state(now)
    dp.seed(state, now)
    for step in steps:
        frame = bytes(step.frame)
        model = (rm.egress if step.egress else rm.ingress)(state, frame, now)
        want = {r: (1, 0 if r == "flow_new" else len(frame)) for r in step.reasons}
        assert (model.verdict, model.counts) == (step.verdict, want), "the model"
        expected = step.out if step.out is not None else frame
        assert_frame(model.frame, expected, "the model's output")
        check_frame(dp, state, frame, step.egress)
        state.apply(model, now)
    check_tables(dp, state, "after the steps")


# -- program size and clock --------------------------------------------------------------------


def test_verifier_instruction_counts(dp: Datapath, capsys: pytest.CaptureFixture[str]) -> None:
    """Verified and translated instructions of each program and of the full path it hands
    uncommon frames to (a program of its own, bpf/lib/tail.h), printed so that CI logs show
    their growth; far below the kernel's limit of 1,000,000 verified instructions."""
    counts = {}
    for name, prog in dp.progs.items():
        counts[name] = bpfsys.prog_info(prog.fd)
        slow = loader.slow_program_fd(prog)
        assert slow is not None, f"{name} has no full path"
        counts[f"{name} full path"] = bpfsys.prog_info(slow)
        for more, _, _ in loader.MORE_PATHS.get(prog.name, ()):
            fd = loader.slow_program_fd(prog, more)
            assert fd is not None, f"{name} has no {more}"
            counts[f"{name} {more}"] = bpfsys.prog_info(fd)
    with capsys.disabled():
        print()
        for name, info in counts.items():
            print(f"{name}: {info.verified_insns} verified, {info.xlated_insns} xlated insns")
    for name, info in counts.items():
        assert 0 < info.verified_insns < 500_000, name


def test_timestamps_are_the_monotonic_clocks(dp: Datapath) -> None:
    """Fragment entries are seeded with time.monotonic_ns(): the first fragment's timestamp
    (bpf_ktime_get_ns) must be CLOCK_MONOTONIC. A flow's is bpf_ktime_get_coarse_ns (a tenth
    of the cost on the egress path, and exact enough for a refresh once a second):
    CLOCK_MONOTONIC_COARSE."""
    dp.clear()
    pod, lb = _a(POD_FILT), _a(LB_FILT)
    dp.seed(RefState(pod={pod: Pod(lb, PORT_FILTER)}), 0)
    coarse = getattr(time, "CLOCK_MONOTONIC_COARSE", 6)  # 6 on Linux; Python names it on 3.13+
    before = time.clock_gettime_ns(coarse)
    dp.run("egress", bytes(v4(CLIENT, src=POD_FILT) / TCP(sport=1, dport=2)))
    after = time.clock_gettime_ns(coarse)
    (key,) = bpfsys.map_keys(dp.maps.fds[FLOW4.name], FLOW4.key_size)
    val = layout.Flow4Val()
    assert bpfsys.map_lookup(dp.maps.fds[FLOW4.name], FLOW4.key.from_buffer_copy(key), val)
    assert before <= val.last_seen_ns <= after
    frag = v4(POD_FILT, id=30, flags="MF") / UDP(sport=5000, dport=9) / (b"q" * 16)
    before = time.monotonic_ns()
    dp.run("xdp", bytes(frag))
    after = time.monotonic_ns()
    (fkey,) = bpfsys.map_keys(dp.maps.fds[FRAG4.name], FRAG4.key_size)
    fval = layout.FragVal()
    assert bpfsys.map_lookup(dp.maps.fds[FRAG4.name], FRAG4.key.from_buffer_copy(fkey), fval)
    assert before <= fval.seen_ns <= after and not fval.passed


def test_the_flow_hint_bit_is_the_same_in_c_and_python(dp: Datapath) -> None:
    """The egress program sets a new flow's bit in its half of the flow hint; user space
    (layout.flow_hint_bit) computes the same bit for flows it seeds."""
    dp.clear()
    pod, lb = _a(POD6_FILT), _a(LB6_FILT)
    dp.seed(RefState(pod={pod: Pod(lb, PORT_FILTER)}), 0)
    fd, lay = dp.maps.fds["flowhint"], dp.maps.layout
    for words in range(2 * lay.hint_words):  # start from an empty hint
        bpfsys.map_update(fd, ctypes.c_uint32(words), ctypes.c_uint64(0))
    dp.run("egress", bytes(v6(CLIENT6, src=POD6_FILT) / UDP(sport=40001, dport=53)))
    bit = layout.flow_hint_bit(pod.packed, _a(CLIENT6).packed, 40001, 53, rm.UDP, lay.hint_log2)
    got = ctypes.c_uint64()
    assert bpfsys.map_lookup(fd, ctypes.c_uint32(2 * (bit >> 6)), got)  # the programs' word
    assert got.value == 1 << (bit & 63)
