"""The differential test's generator (tests/datapath/test_differential.py): map states and
frames for the programs and the reference model (tests/support/refmodel.py).

A scenario is one map state (a Seed: LB IP/pod pairs, allowed ports, flows and their ages,
fragments, source ranges, Services' limits and how full their buckets are, whether egress is
shaped and how far each Service's shaper runs ahead) and a batch of frames (with their skb's
GSO segments, wire_len and skb->tstamp): valid, edge-case and malformed, aimed at the state's
addresses, ports and flows often enough to meet them. Frames are built with struct (scapy is
far too slow for this volume). `FEATURES` selects the classes of input that are generated.
Environment: CZ_DIFF_EXAMPLES (map states per run, default 2000), CZ_DIFF_FEATURES
(comma-separated classes instead of FEATURES).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, ip_network
from typing import Any, TypeVar

from hypothesis import strategies as st

from cozyebpf.datapath.buckets import Bucket
from cozyebpf.explain import inet_csum
from cozyebpf.state import Limits
from tests.support import refmodel as rm
from tests.support.refmodel import (
    ALLOW_ICMP,
    LEARN,
    LIMIT,
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
    Svc,
    Tats,
    ToLb,
    limit_buckets,
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
        "learn",  # migrating pods (CZ_F_LEARN), TCP with every kind of flags
        "spoof",  # egress entering by no device, the pod's cached one, or another (spoofed)
        "limits",  # Services' limits, their buckets new, idle or a few packets from refusing
        # egress shaped (the uplinks' fq): the shaper busy, idle, new or past its horizon;
        # frames from LB IPs at the uplink; skb->tstamp set or not (needs "limits")
        "shaped",
        "gso",  # GSO packets out: the skb's wire_len (and gso_segs), what a limit charges
        # the node's own packets (and its pods' it forwards) to LB IPs, at the uplink's egress
        # (to_lb4: decided as ingress, handed to the pod's device; too big for it,
        # fragmentation-needed): the egress program runs in a namespace whose routes are TO_LB
        "to-lb",
    }
)
# Disabled classes, and why (to narrow a run down, or to run one: CZ_DIFF_FEATURES=ipv4,...):
# - "gso-in", GRO packets into tc ingress (the skb's gso_segs): both paths charge the packet
#   bucket its segments, but the byte bucket differs by path: the fast path what the segments
#   put on the wire (fast_wire_len: the headers once per segment), the full path the length
#   (slow_end in bpf/lib/account.h). The model would have to know which frames the fast path
#   decides (untagged, no IPv4 options or IPv6 extension headers, TCP or UDP, not a fragment,
#   inside a restricted pod's ranges, ...); before the full path charged the segments, this
#   class found that in the first few hundred examples. On when both paths charge alike.
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


def address(text: str) -> Addr:
    return IPv6Address(text) if ":" in text else IPv4Address(text)


@dataclass(frozen=True)
class Pools:
    lbs: tuple[Addr, ...]
    pods: tuple[Addr, ...]
    remotes: tuple[Addr, ...]
    other: Addr  # nobody's


POOLS = {
    4: Pools(
        tuple(address(f"203.0.113.{i}") for i in (1, 2, 3)),
        tuple(address(f"10.244.0.{i}") for i in (1, 2, 3)),
        tuple(address(f"198.51.100.{i}") for i in (1, 2)),
        address("192.0.2.99"),
    ),
    6: Pools(
        tuple(address(f"2001:db8:1b::{i}") for i in (1, 2, 3)),
        tuple(address(f"fd00:10:244::{i}") for i in (1, 2, 3)),
        tuple(address(f"2001:db8:c::{i}") for i in (1, 2)),
        address("2001:db8:ff::99"),
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
#: the devices of "spoof" (ifindexes that exist nowhere, checked by the test: the FIB, asked
#: about one, fails, so a packet from a managed pod IP entering by one is spoofed unless the
#: pod's addr value caches that very device): the first two are what a pod's value may cache
SPOOF_DEVS = (2_000_000_001, 2_000_000_002, 2_000_000_003)
#: "to-lb": the node's FIB (its address on the uplink, the pods' prefix behind a pod-facing
#: device of an MTU that the larger frames exceed: fragmentation-needed), and a pod of that
#: prefix that no pair manages (a client pod the node forwards for)
TO_LB = ToLb(frozenset({IPv4Address("192.0.2.1")}), IPv4Network("10.244.0.0/16"), 96)
TO_LB_CLIENT_POD = IPv4Address("10.244.0.9")
#: the limits a Service may get: rates so low that a bucket a few packets from full refuses
#: within a batch (1 packet/s: a burst of 64 packets; 1-8 kbit/s: 64 KiB), the node's guard,
#: and rates no batch comes near (charged all the same); one direction or both
LIMIT_SETS = (
    Limits(ingress_pps=1),
    Limits(ingress_bps=1_000, egress_bps=8_000, ingress_pps=1),
    Limits(ingress_bps=8_000, egress_bps=1_000),
    Limits(ingress_bps=2_000, ingress_pps=1_000_000, guard=True),
    Limits(egress_bps=4_000),
    Limits(ingress_bps=10**10, egress_bps=10**10, ingress_pps=10**6),
)
#: how full a seeded bucket is: room for this many frames of 100 bytes (or packets) before it
#: refuses; None: a new bucket (time 0); -1: idle for a second (its time behind the clock); -2:
#: written on the other clock the programs may read, OTHER_CLOCK_NS ahead (full: limit.h,
#: CZ_AHEAD_MAX_NS)
ROOMS = (None, None, -1, -2, 0, 1, 3, 8)
#: how far jiffies times the tick's length runs ahead of the coarse clock, at the least (HZ
#: 1000: 49.7 days)
OTHER_CLOCK_NS = (2**32 - 300 * 1000) * 10**6
#: the segments of a GSO (GRO) packet, now and then, and the headers each carries on the wire
#: (Ethernet, IPv4 and TCP with timestamps): a frame of 45 segments is charged 2,904 bytes more
GSO_SEGS = (0,) * 9 + (2, 3, 45)
GSO_HEADERS = 66
#: the skb->tstamp an egress frame comes with, relative to the batch's start: none, a socket's
#: departure 5 ms ahead (TCP's pacing), one a second past
TSTAMPS = (0,) * 4 + (5_000_000, -1_000_000_000)

# -- map states ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """An LB IP and its pod; either map entry may be missing. `service` names their Service
    ("": none, counted in slot 0); `limited`: LIMIT on the LB IP's entry, on the pod's."""

    lb: Addr
    pod: Addr
    flags: int
    in_svc: bool = True
    in_pod: bool = True
    service: str = ""
    limited: tuple[bool, bool] = (False, False)


@dataclass(frozen=True)
class Seed:
    """A generated map state; frag entries carry whether they have expired."""

    pairs: tuple[Pair, ...]
    allow: tuple[AllowKey, ...] = ()
    flows: tuple[FlowKey, ...] = ()
    frags: tuple[tuple[FragKey, bool, bool], ...] = ()  # key, passed, expired
    ranges: tuple[tuple[Addr, frozenset[Net]], ...] = ()  # restricted pods
    flow_ages: tuple[tuple[FlowKey, int, bool], ...] = ()  # key, age (s), closing
    devs: tuple[tuple[Addr, int], ...] = ()  # the pods' cached devices (addr value `dev`)
    limits: tuple[tuple[str, Limits], ...] = ()  # the Services' limits
    #: how far each bucket's time (in_bytes, in_pkts, out_bytes) runs ahead of the clock at the
    #: start, ns (negative: behind it, idle); 0: a new bucket, time 0
    buckets: tuple[tuple[str, tuple[int, int, int]], ...] = ()
    #: egress shaped (the uplinks have fq: CZ_CFG_SHAPED), not policed
    shaped: bool = False
    #: how far each Service's shaper (its next departure, out_edt) runs ahead of CLOCK_MONOTONIC
    #: at the start, ns (negative: behind it, idle); 0: none
    edts: tuple[tuple[str, int], ...] = ()

    @functools.cached_property
    def maps(self) -> RefState:
        """The maps, for looking addresses up while frames are generated."""
        return self.state(0)

    def state(self, now_ns: int, limit_ns: int | None = None) -> RefState:
        """The maps; fragment entries are 1 s old, or 60 s (expired) at `now_ns`; the buckets'
        times relative to `limit_ns`, now on the buckets' clock (None: now_ns)."""
        state = RefState(allow=set(self.allow), flow=set(self.flows), ranges=dict(self.ranges))
        state.dev = dict(self.devs)
        state.timeouts = {k: v * 1_000_000_000 for k, v in DIFF_TIMEOUTS.items()}
        for key, age, closing in self.flow_ages:
            state.flow_val[key] = FlowVal(max(0, now_ns - age * 1_000_000_000), closing)
        for p in self.pairs:
            limit_in, limit_out = (LIMIT if x else 0 for x in p.limited)
            if p.in_svc:
                state.svc[p.lb] = Svc(p.pod, p.flags | limit_in, p.service)
            if p.in_pod:
                state.pod[p.pod] = Pod(p.lb, p.flags | limit_out, p.service)
        # the limits of the Services the entries name (a pod entry another pair's replaced may
        # have been its Service's only one)
        named = {s.service for s in state.svc.values()} | {p.service for p in state.pod.values()}
        state.limits = {s: lim for s, lim in self.limits if s in named}
        at = now_ns if limit_ns is None else limit_ns
        for s, ahead in self.buckets:
            if s in named:
                state.buckets[s] = Tats(*(at + a if a else 0 for a in ahead))
        state.shaped = self.shaped
        state.to_lb = TO_LB if "to-lb" in FEATURES else None
        for s, edt in self.edts:  # on CLOCK_MONOTONIC: now_ns's
            if s in named and edt:
                state.buckets[s] = state.buckets.get(s, Tats())._replace(
                    out_edt=max(0, now_ns + edt)
                )
        for key, passed, expired in self.frags:
            age = 60 if expired else 1
            state.frag[key] = Frag(max(0, now_ns - age * 1_000_000_000), passed)
        return state


def families() -> tuple[int, ...]:
    return (4, 6) if "ipv6" in FEATURES else (4,)


def _ahead(draw: st.DrawFn, bucket: Bucket | None, frame: int) -> int:
    """A seeded bucket's time, ahead of the clock (`Seed.buckets`): room for a few frames of
    `frame` bytes (or packets), idle, another clock's, or new."""
    room = pick(draw, ROOMS)
    if bucket is None or room is None:
        return 0
    if room == -2:
        return OTHER_CLOCK_NS
    if room < 0:
        return -1_000_000_000
    return max(1, bucket.tolerance - bucket.cost_ns(room * frame))


@st.composite
def seeds(draw: st.DrawFn) -> Seed:
    pairs: list[Pair] = []
    limits: dict[str, Limits] = {}
    aheads: dict[str, tuple[int, int, int]] = {}
    edts: dict[str, int] = {}
    shaped = {"limits", "shaped"} <= FEATURES and pick(draw, (False, False, True))
    for fam in families():
        pool = POOLS[fam]
        for i in range(1 + draw(_index(len(pool.lbs)))):
            flags = pick(draw, (0, PORT_FILTER, PORT_FILTER | ALLOW_ICMP, ALLOW_ICMP))
            if "learn" in FEATURES and pick(draw, (False, False, True)):
                flags |= LEARN
            where = pick(draw, ("both", "both", "both", "svc", "pod"))
            # the pod of pair i is pods[i], or (rarely) another pair's pod
            pod = pool.pods[pick(draw, (i, i, i, (i + 1) % len(pool.pods)))]
            service, limited = "", (False, False)
            if "limits" in FEATURES and pick(draw, (False, False, True)):
                # a limited Service: pair i of both families may be one Service (one bucket)
                service = pick(draw, (f"diff/svc{i}-{fam}", f"diff/svc{i}"))
                if service not in limits:
                    lim = limits[service] = pick(draw, LIMIT_SETS)
                    in_bytes, in_pkts, out_bytes = limit_buckets(lim)
                    aheads[service] = (
                        _ahead(draw, in_bytes, 100),
                        _ahead(draw, in_pkts, 1),
                        _ahead(draw, out_bytes, 100),
                    )
                    if "shaped" in FEATURES:  # the shaper's, in either mode (policed: untouched)
                        edts[service] = _ahead(draw, out_bytes, 100)
                lim = limits[service]
                # as the agent sets them (compose.py); now and then LIMIT on both entries,
                # whether or not the Service has a limit of that direction
                limited = (lim.ingress, lim.egress_bps is not None)
                if pick(draw, (False, False, True)):
                    limited = (True, True)
            pairs.append(
                Pair(pool.lbs[i], pod, flags, where != "pod", where != "svc", service, limited)
            )
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
    devs: dict[Addr, int] = {}
    if "spoof" in FEATURES:
        for pod in sorted(set(pods), key=lambda a: (a.version, int(a))):
            devs[pod] = pick(draw, (0, SPOOF_DEVS[0], SPOOF_DEVS[0], SPOOF_DEVS[1]))
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
        tuple((p, d) for p, d in devs.items() if d),
        tuple(limits.items()),
        tuple(aheads.items()),
        shaped,
        tuple(edts.items()),
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
    tcp_flags: int = 0x18  # PSH, ACK

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
    in_dev: int = 0  # egress: the device it entered the node by (0: the node sent it)
    gso: int = 0  # a GSO (egress) or GRO (tc ingress) packet of this many segments; 0: none
    #: egress: the skb->tstamp it comes with, ns ahead of the batch's start (CLOCK_MONOTONIC;
    #: a socket's own departure time, or one in the past); 0: none
    tstamp: int = 0

    __repr__ = compact_repr

    def wire_len(self, length: int) -> int:
        """The skb's wire_len for the frame of `length` bytes: a GSO packet's headers once per
        segment (GSO_HEADERS each, as the qdisc layer counts them); 0 (the frame's) for
        another."""
        return length + (self.gso - 1) * GSO_HEADERS if self.gso > 1 else 0


def _payload(n: int, salt: int = 0) -> bytes:
    return bytes((salt + 37 * i) & 0xFF for i in range(n))


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
        hdr = struct.pack("!HHIIBBHHH", ip.sport, ip.dport, 1, 0, 0x50, ip.tcp_flags, 512, 0, 0)
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
    lbs: list[Addr] = []
    if egress:
        # shaped, the uplink's egress shapes what leaves from an LB IP too: more of those
        lbs = [p.lb for p in pairs] if seed.shaped else []
        us = c.pick([p.pod for p in pairs] * 3 + lbs + [pairs[0].lb, pool.other])
    else:
        us = c.pick([p.lb for p in pairs] * 2 + [pairs[0].pod, pool.other])
    them = c.pick(pool.remotes)
    if us in lbs and c.pick((False, False, True)):
        them = c.pick(lbs)  # a VM's packet to another VM's public IP (by the ToR), shaped too
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
    if "learn" in FEATURES and ip.proto == rm.TCP:
        # data, SYN, SYN-ACK, ACK, RST, FIN, none: only a lone SYN opens a connection
        ip = replace(ip, tcp_flags=c.pick((0x18, 0x18, 0x02, 0x12, 0x10, 0x04, 0x01, 0x00)))
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


def to_lb_packet(c: Choices, ip: Ip, seed: Seed) -> Ip:
    """`ip` (IPv4, egress) as the node's own packet to an LB IP (to_lb4): from the node's
    address, a pod it forwards for (managed or not, or an LB IP's pod without a pod entry), or
    a remote or an LB IP (by the ToR); to one of the seed's LB IPs, now and then to an allowed
    port of its pod, or to nobody's; mostly TCP or UDP, of sizes around the pod device's MTU."""
    pairs = [p for p in seed.pairs if p.lb.version == 4]
    node = sorted(TO_LB.node_ips)
    src = c.pick(
        node * 4
        + [TO_LB_CLIENT_POD, TO_LB_CLIENT_POD, pairs[0].pod, pairs[0].lb, POOLS[4].remotes[0]]
    )
    lbs = [p.lb for p in pairs if p.in_svc] or [pairs[0].lb]
    dst = c.pick(lbs * 4 + [POOLS[4].other])
    proto = c.pick((rm.TCP, rm.TCP, rm.UDP, rm.UDP, ip.proto))
    dport = ip.dport
    svc = seed.maps.svc.get(dst)
    allowed = [a.port for a in seed.allow if svc and a.pod_ip == svc.pod_ip and a.proto == proto]
    if allowed and c.one_in(2):
        dport = c.pick(allowed)
    payload = c.pick((0, 9, 40, 80))  # 80: over the MTU (TO_LB), with either header
    options = c.pick((0, 0, 0, ip.options))
    return replace(ip, src=src, dst=dst, proto=proto, dport=dport, payload=payload, options=options)


def make_frame(c: Choices, seed: Seed, history: Sequence[Frame]) -> Frame:
    egress = c.pick((False, False, True))
    gso = c.pick(GSO_SEGS) if ("gso" if egress else "gso-in") in FEATURES else 0
    tstamp = c.pick(TSTAMPS) if egress and seed.shaped else 0
    family = c.pick(families())
    ip = fresh_packet(c, seed, family, egress)
    if "fragments" in FEATURES and c.one_in(6):
        kind = c.pick(("first", "middle", "last"))
        ip = replace(ip, frag=kind, frag_id=c.pick(FRAG_IDS), udp_len_datagram=c.one_in(2))
    if not egress and c.one_in(2):
        ip = aimed_packet(c, ip, seed, history)
    if ip.frag and "fragments" not in FEATURES:
        ip = replace(ip, frag="")
    to_lb = egress and family == 4 and "to-lb" in FEATURES and c.one_in(2)
    if to_lb:
        ip = to_lb_packet(c, ip, seed)
        gso = 0  # (to_lb4 charges the segments' headers: fast_wire_len)
    translated = None
    if ip.csum == "zero-after":
        maps = seed.maps
        if egress and ip.src in maps.pod:
            translated = (ip.src, maps.pod[ip.src].lb_ip)
        elif (to_lb or not egress) and ip.dst in maps.svc:
            translated = (ip.dst, maps.svc[ip.dst].pod_ip)
    in_dev = 0
    if egress and "spoof" in FEATURES:
        # mostly by no device or by the cached one (the packet is translated as before),
        # one in six by another device (spoofed, if its source is a managed pod IP)
        own = dict(seed.devs).get(ip.src, 0)
        kind = c.pick(("none", "none", "own", "own", "own", "other"))
        if kind == "own":
            in_dev = own
        elif kind == "other":
            in_dev = c.pick([d for d in SPOOF_DEVS if d != own])
    frame = Frame(
        egress,
        ip,
        vlans=c.pick(VLANS) if "vlan" in FEATURES else (),
        ethertype=c.pick((None,) * 40 + (0x0806, 0x0800, 0x86DD)),
        mangle=c.pick(MANGLES) if "malformed" in FEATURES else "",
        arg=c.pick(range(60)),
        pad=c.pick((0,) * 8 + (1, 6, 30)),
        translated=translated,
        in_dev=in_dev,
        gso=gso if ip.proto in (rm.TCP, rm.UDP) else 0,
        tstamp=tstamp,
    )
    if to_lb and not c.one_in(4):  # most as the node sends them: untagged, well formed
        frame = replace(frame, vlans=(), ethertype=None, mangle="")
    return frame


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
