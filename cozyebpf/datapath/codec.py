"""The maps' keys and values as bytes, and the mirror of the state that encodes addr values.

Every layout comes from the ctypes mirrors of bpf/lib/types.h (layout.py, checked against C by
tests/unit/test_layout.py): `packer()` turns a mirror into a struct.Struct at the mirror's offsets,
so that a full read or write (130,000 addr values at 65,536 Services) packs and unpacks whole
values without building a ctypes object for each.

An addr4 (or addr6) value says whether its address is an LB IP (its pod IP and filter flags), a
pod IP (the LB IP its egress leaves as), or both, and carries up to INLINE_PORTS allowed ports of
the pod its ingress reaches; allow4/allow6 hold every allowed port, and the programs look there
only for a pod with more ports than fit inline. The control plane keeps speaking MapState, so
the mirror (`Mirror`) tells which addr values an allowed-port change rewrites.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Collection
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import NamedTuple

from cozyebpf.datapath.layout import (
    F_ALLOW_ICMP,
    F_LEARN,
    F_LIMIT,
    F_PORT_FILTER,
    F_RANGES,
    INLINE_PORTS,
    K_LB,
    K_POD,
    PORTS_SPILL,
    Addr4Val,
    Addr6Val,
    Allow4Key,
    Allow6Key,
    CzPort,
    Range4Key,
    Range6Key,
)
from cozyebpf.state import AllowedPort, IPAddress, MapState, PodEntry, Ranges, ServiceEntry

_INTS = {1: "B", 2: "H", 4: "I", 8: "Q"}


def packer(
    mirror: type[ctypes.Structure], raw: Collection[str] = (), order: str = "="
) -> struct.Struct:
    """A struct.Struct of `mirror`'s fields at its offsets: those named in `raw` (addresses,
    arrays) as bytes, the others as unsigned integers in byte `order` ("=" native, "!" network:
    for structs whose only multi-byte integers are ports)."""
    fmt, at = order, 0
    for name, *_ in mirror._fields_:
        field = getattr(mirror, name)
        fmt += f"{field.offset - at}x" + (f"{field.size}s" if name in raw else _INTS[field.size])
        at = field.offset + field.size
    return struct.Struct(f"{fmt}{ctypes.sizeof(mirror) - at}x")


class AddrVal(NamedTuple):
    """An addr4/addr6 value (struct addr4_val): addresses and inline ports as bytes."""

    pod_ip: bytes
    kind: int
    flags: int
    pod_flags: int
    nports: int
    lb_ip: bytes
    ports: bytes
    in_slot: int
    out_slot: int
    dev: int  # the programs' cache (cz_spoofed): user space writes 0 and never compares it


_ADDR_RAW = ("pod_ip", "lb_ip", "ports")
#: by the length of the address
ADDR_VAL = {4: packer(Addr4Val, _ADDR_RAW), 16: packer(Addr6Val, _ADDR_RAW)}
assert all(AddrVal._fields == tuple(f[0] for f in v._fields_) for v in (Addr4Val, Addr6Val))
assert all(v.dev.offset == ctypes.sizeof(v) - 4 for v in (Addr4Val, Addr6Val))  # same_addr_val
CZ_PORT = packer(CzPort, (), "!")
ALLOW_KEY = {4: packer(Allow4Key, ("pod_ip",), "!"), 16: packer(Allow6Key, ("pod_ip",), "!")}
RANGE_KEY = {4: packer(Range4Key, ("pod_ip", "src")), 16: packer(Range6Key, ("pod_ip", "src"))}
_ZERO = {4: bytes(4), 16: bytes(16)}


def address(raw: bytes) -> IPAddress:
    return IPv4Address(raw) if len(raw) == 4 else IPv6Address(raw)


def same_addr_val(a: bytes, b: bytes) -> bool:
    """Do two addr values say the same, the programs' cache (`dev`, last) aside?"""
    return a[:-4] == b[:-4]


def addr_val(raw: bytes, n: int) -> AddrVal:
    """The addr value `raw` of an address of `n` bytes."""
    return AddrVal._make(ADDR_VAL[n].unpack(raw))


def flags_of(e: ServiceEntry | PodEntry) -> int:
    """The CZ_F_* flags of an entry (without F_RANGES: the ranges map says that)."""
    return (
        (F_PORT_FILTER if e.port_filter else 0)
        | (F_ALLOW_ICMP if e.allow_icmp else 0)
        | (F_LEARN if e.learning else 0)
        | (F_LIMIT if e.limited else 0)
    )


def service_entry(addr: bytes, flags: int, service: str = "") -> ServiceEntry:
    """The ServiceEntry of an LB role: its pod IP (packed) and its flags."""
    pf, icmp, learn, lim = (
        bool(flags & f) for f in (F_PORT_FILTER, F_ALLOW_ICMP, F_LEARN, F_LIMIT)
    )
    return ServiceEntry(address(addr), pf, icmp, service, learn, lim)


def pod_entry(addr: bytes, flags: int, service: str = "") -> PodEntry:
    """The PodEntry of a pod role: its LB IP (packed) and its flags."""
    pf, icmp, learn, lim = (
        bool(flags & f) for f in (F_PORT_FILTER, F_ALLOW_ICMP, F_LEARN, F_LIMIT)
    )
    return PodEntry(address(addr), pf, icmp, service, learn, lim)


def allow_key(a: AllowedPort) -> bytes:
    pod = a.pod_ip.packed
    return ALLOW_KEY[len(pod)].pack(pod, int(a.proto), 0, a.port)


def range_key(pod: bytes, net: IPv4Network | IPv6Network) -> bytes:
    """A range4/range6 key: prefixlen covers the pod IP and the network."""
    plen = 8 * len(pod) + net.prefixlen
    return RANGE_KEY[len(pod)].pack(plen, pod, net.network_address.packed)


def range_of(raw: bytes) -> tuple[bytes, IPv4Network | IPv6Network]:
    """(pod IP, network) of a range4/range6 key."""
    n = 4 if len(raw) == RANGE_KEY[4].size else 16
    plen, pod, addr = RANGE_KEY[n].unpack(raw)
    net: IPv4Network | IPv6Network
    net = IPv4Network((addr, plen - 32)) if n == 4 else IPv6Network((addr, plen - 128))
    return pod, net


def ports_bytes(ports: Collection[tuple[int, int]]) -> tuple[int, bytes]:
    """(nports, ports[]) of an addr value from (protocol, port) pairs: sorted, the first
    INLINE_PORTS of them inline; more than that is marked PORTS_SPILL (allow4/allow6 hold them
    all)."""
    ps = sorted(ports)
    n = len(ps) if len(ps) <= INLINE_PORTS else PORTS_SPILL
    inline = b"".join(CZ_PORT.pack(proto, 0, port) for proto, port in ps[:INLINE_PORTS])
    return n, inline.ljust(CZ_PORT.size * INLINE_PORTS, b"\0")


#: a pod's allowed ports in the mirror: (protocol, port) pairs
PortSet = frozenset[tuple[int, int]]
_NO_PORTS: PortSet = frozenset()


class Mirror:
    """What the maps hold, keyed by packed addresses (cheap to hash, unlike ipaddress objects):
    enough to encode any addr value without reading the maps. Each role (an LB IP, a pod IP)
    names the Service it is counted for; `refs` says how many roles name each Service (those
    named by none give their counter slot back).

    Kept small (issue 48: one per Service): a pod's allowed ports are a frozenset shared by
    every pod with the same ports (`_sets`: Services repeat a few port lists), their encoding
    is cached per set, not per pod, and the LB IPs that go to a pod are a tuple (mostly one)."""

    def __init__(self) -> None:
        self.svc: dict[bytes, tuple[bytes, int, str]] = {}  # LB IP -> (pod IP, flags, Service)
        self.pod: dict[bytes, tuple[bytes, int, str]] = {}  # pod IP -> (LB IP, flags, Service)
        self.ports: dict[bytes, PortSet] = {}  # pod IP -> (protocol, port)s
        #: pod IP -> the LB IP that goes there, or a tuple of those (`lbs`: mostly one; a
        #: tuple of one was 48 bytes more per pod)
        self.lbs_of: dict[bytes, bytes | tuple[bytes, ...]] = {}
        self.refs: dict[str, int] = {}  # Service -> roles that name it
        self.ranges: dict[bytes, Ranges] = {}  # restricted pod IP -> its source ranges
        self._sets: dict[PortSet, PortSet] = {_NO_PORTS: _NO_PORTS}  # each port set once
        self._enc: dict[PortSet, tuple[int, bytes]] = {}  # a port set's encoding (a cache)

    @classmethod
    def of(cls, st: MapState) -> Mirror:
        m = cls()
        for lb, s in st.services.items():
            m.link(lb.packed, s.pod_ip.packed, flags_of(s), s.service)
        for p, e in st.pods.items():
            m.set_pod(p.packed, e.lb_ip.packed, flags_of(e), e.service)
        for a in st.allowed:
            m.add_port(a.pod_ip.packed, int(a.proto), a.port)
        m.ranges = {p.packed: nets for p, nets in st.ranges.items()}
        return m

    def _shared(self, ports: PortSet) -> PortSet:
        return self._sets.setdefault(ports, ports)

    def _pod_key(self, pod: bytes) -> bytes:
        """`pod` as the bytes object an LB role's value holds (one object for an address in
        every dict: 37 bytes each, about 100 per Service)."""
        lbs = self.lbs_of.get(pod)
        if lbs is not None:
            s = self.svc.get(lbs if isinstance(lbs, bytes) else lbs[0])
            if s is not None and s[0] == pod:
                return s[0]
        return pod

    def _lb_key(self, pod: bytes, lb: bytes) -> bytes:
        """`lb` as the bytes object that keys its LB role, when it goes to `pod`."""
        lbs = self.lbs_of.get(pod)
        if isinstance(lbs, bytes):
            return lbs if lbs == lb else lb
        return next((x for x in lbs if x == lb), lb) if lbs is not None else lb

    def add_port(self, pod: bytes, proto: int, port: int) -> None:
        mine = self.ports.get(pod)
        if mine is None:  # a new key: the object the LB roles hold
            pod, mine = self._pod_key(pod), _NO_PORTS
        self.ports[pod] = self._shared(mine | {(proto, port)})

    def del_port(self, pod: bytes, proto: int, port: int) -> None:
        mine = self.ports.get(pod)
        if mine is None:
            return
        rest = mine - {(proto, port)}
        if rest:
            self.ports[pod] = self._shared(rest)
        else:
            del self.ports[pod]

    def _ref(self, service: str, step: int) -> None:
        if service:
            n = self.refs.get(service, 0) + step
            if n:
                self.refs[service] = n
            else:
                del self.refs[service]

    def link(self, lb: bytes, pod: bytes, flags: int, service: str) -> None:
        self.unlink(lb)
        if pod in self.lbs_of:  # another LB IP goes there: its object
            pod = self._pod_key(pod)
        self.svc[lb] = (pod, flags, service)
        self._ref(service, 1)
        lbs = self.lbs(pod)
        if lb not in lbs:
            self.lbs_of[pod] = (*lbs, lb) if lbs else lb

    def unlink(self, lb: bytes) -> str | None:
        """Remove the LB role of `lb`; the Service it named, if any."""
        old = self.svc.pop(lb, None)
        if old is None:
            return None
        self._ref(old[2], -1)
        rest = tuple(x for x in self.lbs(old[0]) if x != lb)
        if len(rest) > 1:
            self.lbs_of[old[0]] = rest
        elif rest:
            self.lbs_of[old[0]] = rest[0]
        else:
            self.lbs_of.pop(old[0], None)
        return old[2]

    def lbs(self, pod: bytes) -> tuple[bytes, ...]:
        """The LB IPs that go to `pod`."""
        v = self.lbs_of.get(pod)
        if v is None:
            return ()
        return (v,) if isinstance(v, bytes) else v

    def set_pod(self, pod: bytes, lb: bytes, flags: int, service: str) -> None:
        """Set the pod role of `pod`. Its key and `lb` are the objects the LB roles hold when
        those are set first (apply and read_state link the LB IPs before the pods)."""
        self.del_pod(pod)
        pod = self._pod_key(pod)
        self.pod[pod] = (self._lb_key(pod, lb), flags, service)
        self._ref(service, 1)

    def del_pod(self, pod: bytes) -> str | None:
        """Remove the pod role of `pod`; the Service it named, if any."""
        old = self.pod.pop(pod, None)
        if old is None:
            return None
        self._ref(old[2], -1)
        return old[2]

    def value(self, addr: bytes, slot_of: Callable[[str], int]) -> bytes | None:
        """The addr value of `addr`, with the counter slots `slot_of` gives its Services; None
        when it is neither an LB IP nor a pod IP."""
        svc, pod = self.svc.get(addr), self.pod.get(addr)
        if svc is None and pod is None:
            return None
        zero = _ZERO[len(addr)]
        lb, pod_flags, pod_svc = pod if pod is not None else (zero, 0, "")
        out_slot = slot_of(pod_svc) if pod_svc else 0
        if svc is not None:  # ingress uses the LB role
            to, flags, in_svc = svc
            in_pod, in_slot = to, slot_of(in_svc) if in_svc else 0
        else:  # traffic to the pod IP directly: no rewrite, the pod's flags and Service; no
            # limit (the limits are the public IP's: F_LIMIT here is the pod's egress limit)
            to, flags, in_pod, in_slot = zero, pod_flags & ~F_LIMIT, addr, out_slot
        kind = (K_LB if svc is not None else 0) | (K_POD if pod is not None else 0)
        if in_pod in self.ranges:
            flags |= F_RANGES
        if pod is not None and addr in self.ranges:
            pod_flags |= F_RANGES  # egress records the flows, so that replies pass
        mine = self.ports.get(in_pod, _NO_PORTS)
        enc = self._enc.get(mine)
        if enc is None:
            enc = self._enc[mine] = ports_bytes(mine)
        nports, ports = enc
        return ADDR_VAL[len(addr)].pack(
            to, kind, flags, pod_flags, nports, lb, ports, in_slot, out_slot, 0
        )
