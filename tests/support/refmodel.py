"""A reference model of docs/datapath-semantics.md, for the differential tests.

`ingress(state, frame, now_ns)` and `egress(state, frame, now_ns)` say what the datapath must do
with one frame: the verdict, the output frame, the counters it increments and the entries it
records in the flow and fragment tables. `RefState` holds the maps as plain Python values. The
XDP and the tc ingress programs must both match `ingress()`.

The model is written from the spec, not from bpf/: headers are parsed with `struct` and
checksums are computed over the bytes they cover, never patched word by word.

Checksums of invalid inputs. The datapath updates checksums incrementally (RFC 1624), so an
input whose checksum is wrong leaves with a checksum wrong by the same amount. The model keeps
that error explicitly: it sums the bytes a checksum covers in the input, checksum field included
(the *residual*: zero when the checksum is right), and writes the checksum that gives the output
the same residual:

    new = (residual(input) - sum(output, with the field zeroed)) mod 0xFFFF

For a correct input this is the full recomputation. For any input it is congruent modulo 0xFFFF
to the incremental update, and as both lie in 0..0xFFFE they are equal. UDP maps a result of 0
to 0xFFFF, and a UDP checksum of 0 ("none") is left alone.

Limits (issue 38). A Service's addresses may carry LIMIT: an LB IP's flags for what comes in,
a pod IP's for what goes out (never for what is sent to the pod IP directly: the limits are the
public IP's, and the control plane leaves LIMIT out of that role's flags). The Service's
limits (`RefState.limits`, cozyebpf.state.Limits) are GCRA buckets
(cozyebpf/datapath/buckets.py, `Bucket`: the arithmetic the programs must do), whose times the
model keeps per Service (`RefState.buckets`, ns of the programs' limits clock). Only a frame
that would otherwise pass is held to them, after the filter: ingress to the byte bucket (the
frame's length) and the packet bucket (one packet; tc's a GRO packet's segments, its skb's
gso_segs), both charged or neither; egress to the byte bucket, charged what the frame puts on
the wire (the skb's wire_len, the qdisc layer's length: a GSO packet's headers once per
segment; never less than the frame's length). A refused frame is dropped as `drop_limit`, not
translated, and records no flow (a first fragment records a drop, for the fragments after it).
`Result.buckets` holds the times the frame moved. The buckets' clock is an argument of its own
(`limit_ns`; the programs' limits may read another clock than the flows'); as the programs read
it themselves, the harness (tests/support/diffharness.py) asks the model for the window of it
around each run.

Shaped egress (`RefState.shaped`: the node's uplinks all have fq, flowcfg's CZ_CFG_SHAPED).
The egress limit is then the uplink's egress's, as a shaper (`shape`): the Service's next
departure (`Tats.out_edt`, ns of CLOCK_MONOTONIC: an argument of its own, `mono_ns`) is the
GCRA time of its byte bucket, its tolerance the horizon (and fq's, 10 s: Bucket.admit_shaped):
a frame departs at max(out_edt, now), which moves by its cost (wire_len, as above), and gets
that departure as its skb->tstamp when the shaper is busy (`Result.tstamp`; an idle shaper
leaves the tstamp as it came); one beyond the horizon is dropped as `drop_limit`, nothing
moved. The policer's bucket is not touched. The uplink's egress shapes the managed pod's
frame it translates (LIMIT on the pod IP) and a frame from a managed LB IP (a VM's,
translated by the pod-facing hook), which it lets go untouched.
Left out: the pod-facing hook (`cz_pod_ingress*`, which in shaped mode translates without
limiting: the harness does not run it, its routing decisions need a FIB of uplinks;
tests/datapath/test_shaping.py runs it with fq), and fq itself (what a departure time does
to the frame: test_shaping.py). BPF_PROG_RUN refuses a wire_len below the frame's length
(EINVAL), so the floor at the frame's length is met only at equality.

The node's own packets to LB IPs (`RefState.to_lb`: pod-facing hooks attached, flowcfg's
CZ_CFG_POD_DEVICES, and the FIB they are routed by; issue 45). The uplink's egress takes an
untagged IPv4 frame from an address that is no managed pod IP (nor, where egress is shaped, an
LB IP) to a managed LB IP (`_to_lb`, to_lb4): a client the FIB routes by the uplink, a pod
behind the uplink, a frame the fast path does not take go on untouched (by the ToR); any other
is decided as ingress decides it, its Service's ingress limits included. A drop is counted as
ingress counts it and records nothing; a pass too big for the pod's device is answered with
fragmentation-needed (the frame becomes the ICMP message, back to the node), else the pod's
flow is recorded and the frame, translated and counted, is handed to the pod's device
(`REDIRECT`, TC_ACT_REDIRECT). The harness runs the egress program in a namespace whose routes
are the model's FIB (tests/support/diffharness.py, `to_lb_netns`).

Where the spec leaves a choice open, the model takes the reading named in a comment marked
"Reading:".
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import NamedTuple, TypeAlias

from cozyebpf.datapath.buckets import AHEAD_MAX_NS, Bucket
from cozyebpf.state import Limits

Addr: TypeAlias = IPv4Address | IPv6Address
Net: TypeAlias = IPv4Network | IPv6Network

# -- constants of the contract -----------------------------------------------------------

PORT_FILTER = 0x01
ALLOW_ICMP = 0x02
LEARN = 0x08  # the pod is migrating: TCP that opens nothing passes (pass_learn)
#: its Service's limits apply: an LB IP's ingress; a pod IP's egress, and ingress sent to it
LIMIT = 0x10

PASS, DROP = "pass", "drop"
#: handed to another device (the node's own packet to an LB IP, to_lb4: to the pod's device,
#: or its fragmentation-needed to the uplink's ingress): TC_ACT_REDIRECT
REDIRECT = "redirect"
XDP_DROP, XDP_PASS = 1, 2
TCX_NEXT, TCX_DROP, TC_REDIRECT = -1, 2, 7

FRAG_LIFETIME_NS = 30 * 1_000_000_000
FLOW_REFRESH_NS = 1_000_000_000  # egress rewrites a flow's time at most once a second
#: the flows' idle timeouts by default (ns): UDP, ICMP echo, TCP/SCTP, TCP after FIN or RST
TIMEOUTS = {
    "udp": 120 * 10**9,
    "icmp": 30 * 10**9,
    "tcp": 432000 * 10**9,
    "tcp_closing": 10 * 10**9,
}
TCP_FIN, TCP_SYN, TCP_RST, TCP_ACK = 0x01, 0x02, 0x04, 0x10

TCP, UDP, SCTP, ICMP, ICMPV6 = 6, 17, 132, 1, 58
PORT_PROTOS = (TCP, UDP, SCTP)
ETH_IPV4, ETH_IPV6 = 0x0800, 0x86DD
VLAN_TPIDS = (0x8100, 0x88A8)
MAX_VLAN_TAGS = 2

HOPOPT, ROUTING, FRAGMENT, ESP, AH, NO_NEXT, DSTOPTS = 0, 43, 44, 50, 51, 59, 60
IPV6_EXT_HEADERS = (HOPOPT, ROUTING, FRAGMENT, AH, DSTOPTS)
MAX_EXT_HEADERS = 6

ICMP_ERRORS = {4: (3, 11, 12), 6: (1, 2, 3, 4)}
ECHO_REQUEST = {4: 8, 6: 128}
ECHO_REPLY = {4: 0, 6: 129}
ND_TYPES = (133, 134, 135, 136, 137)


def icmp_proto(family: int) -> int:
    return ICMP if family == 4 else ICMPV6


def xdp_code(verdict: str) -> int:
    return XDP_PASS if verdict == PASS else XDP_DROP


def tc_code(verdict: str) -> int:
    if verdict == REDIRECT:
        return TC_REDIRECT
    return TCX_NEXT if verdict == PASS else TCX_DROP


# -- the maps ------------------------------------------------------------------------------


class Svc(NamedTuple):
    """svc4/svc6 value; `service`: the Service it is counted for (and whose limits apply),
    "" for none."""

    pod_ip: Addr
    flags: int
    service: str = ""


class Pod(NamedTuple):
    """pod4/pod6 value."""

    lb_ip: Addr
    flags: int
    service: str = ""


class Tats(NamedTuple):
    """A Service's bucket times (`buckets` at its slot): ns of the limits' clock, 0 for a new
    bucket (full); and shaped egress's next departure, `out_edt` (ns of CLOCK_MONOTONIC, the
    clock fq compares skb->tstamp with; 0: none, the shaper idle)."""

    in_bytes: int = 0
    in_pkts: int = 0
    out_bytes: int = 0
    out_edt: int = 0


@functools.cache
def limit_buckets(limits: Limits) -> tuple[Bucket | None, Bucket | None, Bucket | None]:
    """The buckets of a Service's limits, as Tats orders them (None: no such limit)."""
    return (
        None if limits.ingress_bps is None else Bucket.bytes_per_second(limits.ingress_bps),
        None if limits.ingress_pps is None else Bucket.packets_per_second(limits.ingress_pps),
        None if limits.egress_bps is None else Bucket.bytes_per_second(limits.egress_bps),
    )


class AllowKey(NamedTuple):
    pod_ip: Addr
    proto: int
    port: int


@dataclass(frozen=True)
class ToLb:
    """The node's FIB as the path of its own packets to LB IPs asks it (to_lb4, flowcfg's
    CZ_CFG_POD_DEVICES on): the node's own addresses (local: BPF_FIB_LKUP_RET_NOT_FWDED), the
    prefix routed to a pod-facing device and that device's MTU; every other address is routed
    by the uplink."""

    node_ips: frozenset[IPv4Address]
    pod_net: IPv4Network
    pod_mtu: int


class FlowKey(NamedTuple):
    """ICMP echo flows: pod_port is the identifier, remote_port 0."""

    pod_ip: Addr
    remote_ip: Addr
    pod_port: int
    remote_port: int
    proto: int


class FlowVal(NamedTuple):
    """When the pod last sent on the flow, and whether it sent a FIN or RST."""

    seen_ns: int
    closing: bool = False


class FragKey(NamedTuple):
    remote_ip: Addr
    pod_ip: Addr
    id: int
    proto: int


class Frag(NamedTuple):
    seen_ns: int
    passed: bool


@dataclass
class RefState:
    """The maps of both families; an entry's family is that of its addresses."""

    svc: dict[Addr, Svc] = field(default_factory=dict)  # LB IP -> pod IP, flags
    pod: dict[Addr, Pod] = field(default_factory=dict)  # pod IP -> LB IP, flags
    allow: set[AllowKey] = field(default_factory=set)
    flow: set[FlowKey] = field(default_factory=set)
    frag: dict[FragKey, Frag] = field(default_factory=dict)
    #: restricted pods (loadBalancerSourceRanges): pod IP -> the sources it accepts
    ranges: dict[Addr, frozenset[Net]] = field(default_factory=dict)
    #: a flow's value; a flow without one was last seen "now" (never expired), not closing
    flow_val: dict[FlowKey, FlowVal] = field(default_factory=dict)
    timeouts: dict[str, int] = field(default_factory=lambda: dict(TIMEOUTS))
    #: a managed pod's cached device (its addr value's `dev`): the device its IP was last
    #: confirmed to be routed to; none (0): not known yet
    dev: dict[Addr, int] = field(default_factory=dict)
    #: the FIB, as an input: pod IP -> the device the node routes it to; a pod without one, or
    #: a device that does not exist, is confirmed on no device
    routes: dict[Addr, int] = field(default_factory=dict)
    #: the Services with limits (by the name their entries carry)
    limits: dict[str, Limits] = field(default_factory=dict)
    #: their buckets' times; a Service without an entry has new (full) buckets
    buckets: dict[str, Tats] = field(default_factory=dict)
    #: the node's egress limits are shaped (flowcfg's CZ_CFG_SHAPED: every uplink's root qdisc
    #: is fq), not policed
    shaped: bool = False
    #: pod-facing hooks attached (flowcfg's CZ_CFG_POD_DEVICES), and the FIB the node's own
    #: packets to LB IPs are routed by (to_lb4); None: the cluster paths are off
    to_lb: ToLb | None = None

    def apply(self, result: Result, now_ns: int) -> None:
        """Record the entries `result` created or refreshed, as the datapath does."""
        self.flow |= result.new_flows
        self.dev.update(result.devs)
        self.flow_val.update(result.flow_vals)
        self.buckets.update(result.buckets)
        for key, passed in result.frags.items():
            self.frag[key] = Frag(now_ns, passed)

    def live(self, key: FlowKey, now_ns: int) -> bool:
        """Does the flow exist and still admit replies (idle no longer than its timeout)?"""
        if key not in self.flow:
            return False
        val = self.flow_val.get(key)
        if val is None:
            return True
        if key.proto == UDP:
            timeout = self.timeouts["udp"]
        elif key.proto in (TCP, SCTP):
            timeout = self.timeouts["tcp_closing" if val.closing else "tcp"]
        else:
            timeout = self.timeouts["icmp"]
        return now_ns - val.seen_ns <= timeout

    def outside(self, pod_ip: Addr, src: Addr) -> bool:
        """Is `src` outside the source ranges of a restricted pod?"""
        nets = self.ranges.get(pod_ip)
        return nets is not None and not any(src in n for n in nets)


@dataclass(frozen=True)
class Result:
    """What a program does with one frame."""

    verdict: str  # PASS or DROP
    frame: bytes  # the output frame
    counts: dict[str, tuple[int, int]]  # reason -> (packets, bytes) added to the counters
    new_flows: frozenset[FlowKey] = frozenset()
    frags: dict[FragKey, bool] = field(default_factory=dict)  # recorded: key -> passed
    flow_vals: dict[FlowKey, FlowVal] = field(default_factory=dict)  # flows written (egress)
    devs: dict[Addr, int] = field(default_factory=dict)  # pod IP -> its cached device written
    #: the Service the frame is counted for (its per-Service counters), "" for none
    service: str = ""
    buckets: dict[str, Tats] = field(default_factory=dict)  # the bucket times the frame moved
    #: drop_limit: the frame as the pass would have left it. Reading: the bytes of a dropped
    #: frame go nowhere; the full paths check the limits at their end, after their rewrite, so
    #: a frame they refuse may come out translated (the fast paths leave it as it came).
    limit_frame: bytes | None = None
    #: egress: skb->tstamp as the program leaves it (the shaper's departure time, or what it
    #: came with); None for ingress, where it is not compared
    tstamp: int | None = None
    #: decided as ingress (to_lb4, an egress frame): counted in its Service's ingress counters
    inbound: bool = False

    @property
    def clocked(self) -> bool:
        """Did the frame meet a bucket (charged one, or was refused): does the model's answer
        depend on the clock beyond the flows' and fragments' ages?"""
        return bool(self.buckets) or "drop_limit" in self.counts


def _untouched(frame: bytes, service: str = "") -> Result:
    return Result(PASS, frame, {}, service=service)


def _counted(frame: bytes, verdict: str, reason: str, service: str) -> Result:
    return Result(verdict, frame, {reason: (1, len(frame))}, service=service)


def police(
    state: RefState, service: str, egress: bool, cost: int, now_ns: int, packets: int = 1
) -> tuple[bool, dict[str, Tats]]:
    """Does the Service's limit admit a frame of `cost` bytes at `now_ns` (ingress: its byte
    and its packet bucket, the frame `packets` packets; egress: its byte bucket), and the
    bucket times it moves (charged only when every bucket admits it)? A Service without
    limits, or without a limit of the direction, admits every frame and moves nothing."""
    limits = state.limits.get(service) if service else None
    if limits is None:
        return True, {}
    in_bytes, in_pkts, out_bytes = limit_buckets(limits)
    tats = state.buckets.get(service, Tats())
    if egress:
        checks = [("out_bytes", out_bytes, cost)]
    else:
        checks = [("in_bytes", in_bytes, cost), ("in_pkts", in_pkts, packets)]
    moved: dict[str, int] = {}
    for name, bucket, units in checks:
        if bucket is None:
            continue
        admitted, end = bucket.admit(getattr(tats, name), now_ns, units)
        if not admitted:
            return False, {}
        moved[name] = end
    return True, ({service: tats._replace(**moved)} if moved else {})


def shape(
    state: RefState, service: str, cost: int, mono_ns: int, tstamp: int
) -> tuple[bool, dict[str, Tats], int]:
    """Shaped egress (`state.shaped`): does the Service's egress limit let a frame of `cost`
    bytes leave, at `mono_ns` (CLOCK_MONOTONIC) with skb->tstamp `tstamp`, and with what: the
    shaper's time it moves and the frame's skb->tstamp. The byte bucket's GCRA on `out_edt`
    (the next departure; the policer's `out_bytes` is not touched): the frame departs at
    max(out_edt, now), which moves by its cost; one that would depart more than the burst's time
    ahead (the horizon) is refused, nothing moved. A Service without an egress limit lets every
    frame go untouched."""
    limits = state.limits.get(service) if service else None
    bucket = limit_buckets(limits)[2] if limits is not None else None
    if bucket is None:
        return True, {}, tstamp
    tats = state.buckets.get(service, Tats())
    admitted, end = bucket.admit_shaped(tats.out_edt, mono_ns, cost)
    if not admitted:
        return False, {}, tstamp
    # Reading: a busy shaper (its departure ahead of now) gives the frame that departure; an
    # idle one lets it leave now, which the program does by leaving skb->tstamp as it came (0,
    # or a socket's own departure time, which fq then keeps) -- it does not write `now`.
    departs = tats.out_edt if mono_ns < tats.out_edt <= mono_ns + AHEAD_MAX_NS else tstamp
    return True, {service: tats._replace(out_edt=end)}, departs


# -- parsing -------------------------------------------------------------------------------


def _u16(b: bytes, off: int) -> int:
    return int(struct.unpack_from("!H", b, off)[0])


def _locate_ip(frame: bytes) -> tuple[int, int] | None:
    """(family, offset of the IP header) after at most two VLAN tags, or None: not IP, a
    third tag, or a frame too short for the header that holds the key address."""
    if len(frame) < 14:
        return None
    ethertype, off = _u16(frame, 12), 14
    for _ in range(MAX_VLAN_TAGS):
        if ethertype not in VLAN_TPIDS:
            break
        if len(frame) < off + 4:
            return None
        ethertype, off = _u16(frame, off + 2), off + 4
    if ethertype == ETH_IPV4 and len(frame) >= off + 20:
        return 4, off
    if ethertype == ETH_IPV6 and len(frame) >= off + 40:
        return 6, off
    return None  # another EtherType (a third VLAN tag included), or too short


def _src_dst(frame: bytes, family: int, l3: int) -> tuple[Addr, Addr]:
    if family == 4:
        return IPv4Address(frame[l3 + 12 : l3 + 16]), IPv4Address(frame[l3 + 16 : l3 + 20])
    return IPv6Address(frame[l3 + 8 : l3 + 24]), IPv6Address(frame[l3 + 24 : l3 + 40])


def _addr_offset(family: int, l3: int, which: str) -> int:
    if family == 4:
        return l3 + (16 if which == "dst" else 12)
    return l3 + (24 if which == "dst" else 8)


@dataclass(frozen=True)
class Packet:
    """A well-formed IP packet for a managed address."""

    family: int
    l3: int  # offset of the IP header
    ip_end: int  # end of the IP header (IPv4 with options; IPv6: the fixed 40 bytes)
    src: Addr
    dst: Addr
    proto: int  # after the IPv6 extension headers
    l4: int  # offset of what follows the IP headers
    end: int  # end of the IP packet: bytes after it are padding
    frag: str  # "" (not a fragment), "first" or "later"
    frag_id: int

    @property
    def has_l4(self) -> bool:
        return self.frag != "later"

    def icmp_type(self, frame: bytes) -> int | None:
        """The ICMP/ICMPv6 type, if this packet carries an ICMP header of its family."""
        if self.has_l4 and self.proto == icmp_proto(self.family):
            return frame[self.l4]
        return None


def _parse_ip(frame: bytes, family: int, l3: int) -> Packet | None:
    """The packet, or None when it is malformed (rule 5)."""
    src, dst = _src_dst(frame, family, l3)
    if family == 4:
        version, ihl = frame[l3] >> 4, (frame[l3] & 0x0F) * 4
        total = _u16(frame, l3 + 2)
        if version != 4 or ihl < 20 or l3 + ihl > len(frame):
            return None
        if total < ihl or l3 + total > len(frame):
            return None
        frag_field = _u16(frame, l3 + 6)
        offset, more = frag_field & 0x1FFF, bool(frag_field & 0x2000)
        frag = "later" if offset else "first" if more else ""
        proto, frag_id = frame[l3 + 9], _u16(frame, l3 + 4)
        return Packet(4, l3, l3 + ihl, src, dst, proto, l3 + ihl, l3 + total, frag, frag_id)
    version, payload = frame[l3] >> 4, _u16(frame, l3 + 4)
    end = l3 + 40 + payload
    if version != 6 or payload == 0 or end > len(frame):
        return None
    nh, off, count, frag, frag_id = frame[l3 + 6], l3 + 40, 0, "", 0
    while nh in IPV6_EXT_HEADERS:
        count += 1
        if count > MAX_EXT_HEADERS:
            return None
        # Reading: a header "fits" when it lies within the payload length (which lies within
        # the frame).
        if off + 2 > end:
            return None
        if nh == FRAGMENT:
            size = 8
        elif nh == AH:
            size = (frame[off + 1] + 2) * 4
        else:
            size = (frame[off + 1] + 1) * 8
        if off + size > end:
            return None
        if nh == FRAGMENT:
            frag_field = _u16(frame, off + 2)
            offset, more = frag_field >> 3, bool(frag_field & 1)
            frag_id = int(struct.unpack_from("!I", frame, off + 4)[0])
            frag = "later" if offset else "first" if more else ""
        nh, off = frame[off], off + size
        if frag == "later":
            # Reading: what follows a non-first fragment header is data, not headers; the
            # protocol is the fragment header's next header.
            break
    return Packet(6, l3, l3 + 40, src, dst, nh, off, end, frag, frag_id)


def _l4_fits(frame: bytes, p: Packet) -> bool:
    """Rule 5: a packet that carries its L4 header carries all of it, inside the IP length."""
    if not p.has_l4:
        return True
    room = p.end - p.l4
    if p.proto == TCP:
        data_offset = (frame[p.l4 + 12] >> 4) * 4 if room >= 20 else 0
        return 20 <= data_offset <= room
    if p.proto == UDP:
        # Reading: the UDP length is that of the whole datagram, so in a first fragment with
        # more to come it exceeds this packet's payload (the spec's "UDP length <= IP payload",
        # taken literally, would drop every fragmented UDP datagram).
        length = _u16(frame, p.l4 + 4) if room >= 8 else 0
        return length >= 8 and (length <= room or p.frag == "first")
    if p.proto == SCTP:
        return room >= 12
    if p.proto == icmp_proto(p.family):
        return room >= 8
    return True


@dataclass(frozen=True)
class Inner:
    """The packet embedded in an ICMP error (validated: its headers are present)."""

    l3: int
    ihl: int  # IPv4 header length; 40 for IPv6
    src: Addr
    dst: Addr
    proto: int
    l4: int


def _inner(frame: bytes, p: Packet) -> Inner | None:
    """The inner packet of the ICMP error `p`, or None when it is invalid: another family, a
    header that does not fit, fewer than 8 bytes of L4 header, or an ICMP error itself.
    Reading: "present" means inside the outer IP length; IPv6 extension headers of the inner
    packet are not walked (its next header is its protocol)."""
    l3 = p.l4 + 8
    if l3 + 1 > p.end:
        return None
    if p.family == 4:
        if frame[l3] >> 4 != 4:
            return None
        ihl = (frame[l3] & 0x0F) * 4
        if ihl < 20 or l3 + ihl > p.end:
            return None
        proto = frame[l3 + 9]
    else:
        if frame[l3] >> 4 != 6 or l3 + 40 > p.end:
            return None
        ihl, proto = 40, frame[l3 + 6]
    l4 = l3 + ihl
    if l4 + 8 > p.end:
        return None
    if proto == icmp_proto(p.family) and frame[l4] in ICMP_ERRORS[p.family]:
        return None  # an error about an error
    src, dst = _src_dst(frame, p.family, l3)
    return Inner(l3, ihl, src, dst, proto, l4)


# -- checksums -----------------------------------------------------------------------------


def _sum(data: bytes) -> int:
    """The one's complement sum of `data` as 16-bit words, modulo 0xFFFF (2**16 == 1 there)."""
    if len(data) % 2:
        data += b"\0"
    return int.from_bytes(data, "big") % 0xFFFF


@dataclass(frozen=True)
class _Csum:
    """A checksum field and what it covers: frame[start:end], after the pseudo-header of the
    IP header at `pseudo_l3` (None: no pseudo-header)."""

    field: int
    start: int
    end: int
    family: int = 4
    pseudo_l3: int | None = None
    proto: int = 0
    udp: bool = False

    def covered(self, frame: bytes) -> bytes:
        data = frame[self.start : self.end]
        if self.pseudo_l3 is None:
            return data
        length = self.end - self.start
        if self.family == 4:
            addrs = frame[self.pseudo_l3 + 12 : self.pseudo_l3 + 20]
            return addrs + struct.pack("!BBH", 0, self.proto, length) + data
        addrs = frame[self.pseudo_l3 + 8 : self.pseudo_l3 + 40]
        return addrs + struct.pack("!IxxxB", length, self.proto) + data


def _rewrite(frame: bytes, writes: dict[int, bytes], csums: list[_Csum]) -> bytes:
    """`frame` with `writes` (offset -> bytes) applied and `csums` (inner ones first) set to
    carry their input residual (see the module docstring)."""
    residuals = [_sum(c.covered(frame)) for c in csums]
    out = bytearray(frame)
    for off, data in writes.items():
        out[off : off + len(data)] = data
    for c, residual in zip(csums, residuals, strict=True):
        if c.udp and _u16(frame, c.field) == 0:
            continue  # no UDP checksum: stays 0
        out[c.field : c.field + 2] = b"\0\0"
        new = (residual - _sum(c.covered(bytes(out)))) % 0xFFFF
        if c.udp and new == 0:
            new = 0xFFFF
        out[c.field : c.field + 2] = new.to_bytes(2, "big")
    return bytes(out)


def _l4_csum(frame: bytes, family: int, l3: int, proto: int, l4: int, end: int) -> _Csum | None:
    """The pseudo-header checksum of a TCP, UDP or ICMPv6 header at l4, if it lies before
    `end`."""
    at = {TCP: 16, UDP: 6, ICMPV6: 2}.get(proto)
    if at is None or (proto == ICMPV6 and family != 6) or l4 + at + 2 > end:
        return None
    return _Csum(l4 + at, l4, end, family, l3, proto, udp=proto == UDP)


def _translate(
    frame: bytes, p: Packet, which: str, new: Addr, inner: Inner | None, inner_new: Addr | None
) -> bytes:
    """Outer `which` ("dst"/"src") := new; with `inner_new`, the inner packet's other address
    (the one naming us: ingress inner src, egress inner dst) := inner_new."""
    writes = {_addr_offset(p.family, p.l3, which): new.packed}
    csums: list[_Csum] = []
    if inner is not None and inner_new is not None:
        inner_which = "src" if which == "dst" else "dst"
        writes[_addr_offset(p.family, inner.l3, inner_which)] = inner_new.packed
        if p.family == 4:
            csums.append(_Csum(inner.l3 + 10, inner.l3, inner.l3 + inner.ihl))
        # Reading: the spec names the inner TCP/UDP checksums; an inner ICMPv6 checksum covers
        # the inner addresses as well and is updated like them.
        if inner.proto in (TCP, UDP, ICMPV6):
            c = _l4_csum(frame, p.family, inner.l3, inner.proto, inner.l4, p.end)
            if c is not None:
                csums.append(c)
        if p.family == 4:  # the outer ICMPv4 checksum covers the inner packet
            csums.append(_Csum(p.l4 + 2, p.l4, p.end))
    if p.family == 4:
        csums.append(_Csum(p.l3 + 10, p.l3, p.ip_end))
    if p.has_l4:
        c = _l4_csum(frame, p.family, p.l3, p.proto, p.l4, p.end)
        if c is not None:
            csums.append(c)
    return _rewrite(frame, writes, csums)


# -- the programs --------------------------------------------------------------------------


def _ports(frame: bytes, p: Packet | Inner) -> tuple[int, int]:
    sport, dport = struct.unpack_from("!HH", frame, p.l4)
    return int(sport), int(dport)


def _echo_id(frame: bytes, l4: int) -> int:
    return _u16(frame, l4 + 4)


def _related(
    state: RefState, frame: bytes, family: int, pod_ip: Addr, inner: Inner, now_ns: int
) -> bool:
    """Is the ICMP error about a packet of an allowed flow of the pod? `inner.src` is the
    inner source after the inner translation."""
    if inner.src != pod_ip:
        # Reading: "its inner packet (pod IP -> remote, after the inner translation)" requires
        # the pod as the inner source; an error quoting someone else's packet is not related.
        return False
    if inner.proto in PORT_PROTOS:
        sport, dport = _ports(frame, inner)
        return (
            state.live(FlowKey(pod_ip, inner.dst, sport, dport, inner.proto), now_ns)
            or AllowKey(pod_ip, inner.proto, sport) in state.allow
        )
    if inner.proto == icmp_proto(family) and frame[inner.l4] == ECHO_REQUEST[family]:
        key = FlowKey(pod_ip, inner.dst, _echo_id(frame, inner.l4), 0, inner.proto)
        return state.live(key, now_ns)
    return False


def _filter(
    state: RefState,
    frame: bytes,
    p: Packet,
    pod_ip: Addr,
    flags: int,
    inner: Inner | None,
    now_ns: int,
    out: bool = False,
) -> str:
    """The port filter's verdict reason (the table of the spec); with `out` (a source outside
    the pod's ranges, either mode) only replies and related errors pass, and the drop is
    drop_source."""

    def drop(reason: str) -> str:
        return "drop_source" if out else reason

    if p.frag == "later":
        entry = state.frag.get(FragKey(p.src, pod_ip, p.frag_id, p.proto))
        # Reading: an entry 30 s old or older is no entry, whether it says pass or drop.
        if entry is None or now_ns - entry.seen_ns >= FRAG_LIFETIME_NS:
            return "drop_frag_orphan"
        return "pass_fragment" if entry.passed else "drop_fragment"
    if p.proto in PORT_PROTOS:
        sport, dport = _ports(frame, p)
        if not out and AllowKey(pod_ip, p.proto, dport) in state.allow:
            return "pass_port"
        if state.live(FlowKey(pod_ip, p.src, dport, sport, p.proto), now_ns):
            return "pass_reply"
        # a migrating pod: TCP that opens no connection (anything but a lone SYN)
        opens = p.proto == TCP and frame[p.l4 + 13] & (TCP_SYN | TCP_ACK) == TCP_SYN
        # Reading: the source ranges come first; a sender outside them is never learned
        # (issue 28), only its replies pass.
        if flags & LEARN and not out and p.proto == TCP and not opens and _fast_shaped(p):
            return "pass_learn"
        return drop("drop_port")
    icmp_type = p.icmp_type(frame)
    if icmp_type is None:
        return drop("drop_proto")
    allow_icmp = bool(flags & ALLOW_ICMP) and not out
    if icmp_type == ECHO_REPLY[p.family]:
        if allow_icmp:
            return "pass_icmp"
        if state.live(FlowKey(pod_ip, p.src, _echo_id(frame, p.l4), 0, p.proto), now_ns):
            return "pass_reply"
        return drop("drop_icmp")
    if inner is not None and _related(state, frame, p.family, pod_ip, inner, now_ns):
        return "pass_related"
    return "pass_icmp" if allow_icmp else drop("drop_icmp")


def _fast_shaped(p: Packet) -> bool:
    """Reading: a migrating pod learns (pass_learn) in the fast paths only (bpf/lib/types.h,
    CZ_F_LEARN; docs/design.md, "Live migration"): an untagged frame, IPv4 without options and
    not a fragment, IPv6 without extension headers. Any other frame is decided as before."""
    return p.l3 == 14 and p.frag == "" and p.l4 == p.l3 + (20 if p.family == 4 else 40)


def ingress(
    state: RefState, frame: bytes, now_ns: int, limit_ns: int | None = None, segs: int = 1
) -> Result:
    """XDP `cz_ingress` and tc `cz_ingress_tc`, at `now_ns` (the flows' and fragments' clock)
    and `limit_ns` (the buckets'; None: now_ns). `segs`: tc's skb->gso_segs (a GRO packet's
    segments; 0 or 1: one packet), what the packet bucket is charged; XDP sees each frame as
    one."""
    where = _locate_ip(frame)
    if where is None:
        return _untouched(frame)
    family, l3 = where
    _, dst = _src_dst(frame, family, l3)
    svc, pod = state.svc.get(dst), state.pod.get(dst)
    if svc is not None:
        pod_ip, flags, service = svc
    elif pod is not None:
        # sent to the pod IP directly: the pod's flags, never its (egress) limit: the limits
        # are the public IP's (the control plane leaves LIMIT out of such an address's flags)
        pod_ip, flags, service = dst, pod.flags & ~LIMIT, pod.service
    else:
        return _untouched(frame)
    p = _parse_ip(frame, family, l3)
    if p is None or not _l4_fits(frame, p):
        return _counted(frame, DROP, "drop_malformed", service)
    icmp_type = p.icmp_type(frame)
    # Reading: neighbour discovery is recognised after the malformed checks.
    if family == 6 and icmp_type in ND_TYPES:
        return _untouched(frame, service)
    is_error = icmp_type in ICMP_ERRORS[family]
    inner = _inner(frame, p) if is_error else None
    # the pod's own packet left with the LB IP as its source: it gets the pod IP back
    inner_new = pod_ip if svc is not None and inner is not None and inner.src == dst else None
    frag = None
    # source ranges: keyed on the pod IP, like the port filter, in either mode
    out = state.outside(pod_ip, p.src)
    if is_error and inner is None:
        reason = "drop_icmp_inner"  # whatever the mode
    elif flags & PORT_FILTER or out:
        translated = replace(inner, src=inner_new) if inner and inner_new else inner
        reason = _filter(state, frame, p, pod_ip, flags, translated, now_ns, out)
        # Reading: what is recorded is the verdict of the port filter and then the limits;
        # packets refused before the filter (drop_malformed, drop_icmp_inner) record nothing.
        if p.frag == "first":
            frag = FragKey(p.src, pod_ip, p.frag_id, p.proto)
    else:
        reason = "nat_ingress"
    verdict = DROP if reason.startswith("drop") else PASS
    result = frame
    if verdict == PASS and svc is not None:
        result = _translate(frame, p, "dst", pod_ip, inner, inner_new)
    buckets: dict[str, Tats] = {}
    limit_frame = None
    if verdict == PASS and flags & LIMIT:
        # the limits hold only what passes the filter; a refused frame is not translated
        at = now_ns if limit_ns is None else limit_ns
        admitted, buckets = police(state, service, False, len(frame), at, max(segs, 1))
        if not admitted:
            reason, verdict, result, limit_frame = "drop_limit", DROP, frame, result
    frags = {frag: verdict == PASS} if frag is not None else {}
    counts = {reason: (1, len(frame))}
    return Result(
        verdict,
        result,
        counts,
        frags=frags,
        service=service,
        buckets=buckets,
        limit_frame=limit_frame,
    )


def _shape_lb(
    state: RefState,
    frame: bytes,
    svc: Svc,
    cost: int,
    mono_ns: int,
    tstamp: int,
) -> Result:
    """Shaped egress, a frame from the LB IP of `svc`: a VM's packet that the pod-facing hook
    translated (Kube-OVN's layout), which the uplink's egress -- the one hook in front of fq --
    shapes as it is, whatever it carries, by the LB IP's Service (the one it is counted for);
    one beyond the horizon is dropped, counted for that Service. Reading: only an untagged
    frame (as the uplink sends it; the full path shapes none), to anywhere (IPv4 to a managed
    LB IP: the path to an LB IP shapes it first, cz_egress_to_lb)."""
    ok, buckets, departs = shape(state, svc.service, cost, mono_ns, tstamp)
    if not ok:
        return _counted(frame, DROP, "drop_limit", svc.service)
    return Result(PASS, frame, {}, service=svc.service, buckets=buckets, tstamp=departs)


def spoofed(state: RefState, pod_ip: Addr, in_dev: int) -> tuple[bool, int | None]:
    """Source verification: is a packet from the managed pod IP `pod_ip` that entered the node
    by device `in_dev` spoofed, and the device to cache for the pod (None: the cache stays)?
    Not spoofed when `in_dev` is 0 (the node's own packet, tc egress), the pod's cached device,
    or the device the FIB routes the pod IP to (the kernel's reverse path, strict rp_filter);
    that confirmation replaces the cache."""
    if in_dev == 0 or in_dev == state.dev.get(pod_ip, 0):
        return False, None
    if state.routes.get(pod_ip) == in_dev:
        return False, in_dev
    return True, None


def _record_flow(
    state: RefState,
    key: FlowKey,
    tcp_flags: int,
    now_ns: int,
    new_flows: set[FlowKey],
    flow_vals: dict[FlowKey, FlowVal],
    counts: dict[str, tuple[int, int]],
) -> None:
    """The pod's flow `key` recorded (new, with flow_new) or refreshed (at most once a second,
    or when a TCP packet changes whether it is closing), as egress records it."""
    old = state.flow_val.get(key, FlowVal(now_ns)) if key in state.flow else None
    closing = old.closing if old is not None else False
    if key.proto == TCP:
        if tcp_flags & (TCP_FIN | TCP_RST):
            closing = True
        elif tcp_flags & TCP_SYN:
            closing = False
    if old is None:
        new_flows.add(key)
        flow_vals[key] = FlowVal(now_ns, closing)
        # Reading: an event counts one packet and no bytes.
        counts["flow_new"] = (1, 0)
    elif closing != old.closing or now_ns - old.seen_ns > FLOW_REFRESH_NS:
        flow_vals[key] = FlowVal(now_ns, closing)


def _fast4(frame: bytes) -> bool:
    """Does the fast path decide the untagged IPv4 frame (parse.h, fast_hdrs4): no options, not a
    fragment, its lengths consistent, and a whole TCP or UDP header inside them? Else the full
    path (or, on the node's path to LB IPs, the ToR) does."""
    if frame[14] != 0x45 or _u16(frame, 20) & 0x3FFF:
        return False
    total = _u16(frame, 16)
    if total < 20 or 14 + total > len(frame):
        return False
    room, proto = total - 20, frame[23]
    if proto == UDP:
        return room >= 8 and 8 <= _u16(frame, 38) <= room
    if proto == TCP:
        return room >= 20 and 20 <= (frame[46] >> 4) * 4 <= room
    return False


def frag_needed(frame: bytes, mtu: int) -> bytes:
    """ICMP fragmentation-needed for the node's own IPv4 packet `frame` (untagged, no options),
    too big for a device of `mtu` (bpf/lib/frag_needed.h): from its destination back to its
    source, the MACs swapped, quoting its IP header and 8 bytes."""
    quote = frame[14:42]
    icmp = struct.pack("!BBHHH", 3, 4, 0, 0, mtu) + quote
    icmp = icmp[:2] + struct.pack("!H", (0xFFFF - _sum(icmp)) % 0xFFFF) + icmp[4:]
    ip = struct.pack("!BBHHHBBH", 0x45, 0xC0, 20 + len(icmp), 0, 0, 64, ICMP, 0)
    ip += frame[30:34] + frame[26:30]
    ip = ip[:10] + struct.pack("!H", (0xFFFF - _sum(ip)) % 0xFFFF) + ip[12:]
    return frame[6:12] + frame[0:6] + struct.pack("!H", ETH_IPV4) + ip + icmp


def is_to_lb(state: RefState, frame: bytes) -> bool:
    """Is the egress frame the node's own (or a pod's it forwards) to a managed IPv4 LB IP, which
    to_lb4 decides as ingress (its limits on the buckets' clock, not the shaper's)?"""
    where = _locate_ip(frame)
    if state.to_lb is None or where != (4, 14):
        return False
    src, dst = _src_dst(frame, 4, 14)
    if src in state.pod or (state.shaped and src in state.svc):
        return False
    return dst in state.svc


def _to_lb(state: RefState, fib: ToLb, frame: bytes, now_ns: int, limit_ns: int | None) -> Result:
    """Uplink egress, the node's own packet (or a pod's it forwards: its source no managed pod
    IP) to a managed LB IP whose pod sits behind a pod-facing device (to_lb4): a client the FIB
    routes by the uplink, a pod routed by the uplink, a frame the fast path does not take: it
    goes by the ToR, untouched. Else decided as ingress decides it (the filter, the Service's
    ingress limits); a drop is counted as ingress counts it, and records nothing. Let in: larger
    than the pod's device, fragmentation-needed goes back to the node (nothing counted or
    recorded; Reading: its bucket was charged, as the decision charged it); else the pod's flow
    is recorded (whatever the pod's mode: keyed as its answer will be, pod_side4's) and the
    frame, translated and counted, is handed to the pod's device."""
    src, dst = _src_dst(frame, 4, 14)
    # Reading: the FIB's answer for the client's route is the kernel's for this skb: a route to
    # a pod-facing device whose MTU the frame exceeds (is_skb_forwardable: the MTU, an Ethernet
    # and a VLAN header) is BPF_FIB_LKUP_RET_FRAG_NEEDED, and the frame goes on untouched (a
    # pod's packet came in by that device, so on a node it fits it)
    client_ok = src in fib.node_ips or (src in fib.pod_net and len(frame) <= fib.pod_mtu + 14 + 4)
    pod_ip = state.svc[dst].pod_ip
    if not client_ok or pod_ip not in fib.pod_net or not _fast4(frame):
        return _untouched(frame)
    r = ingress(state, frame, now_ns, limit_ns, 1)
    if r.verdict == DROP:
        return replace(r, inbound=True)
    if len(frame) - 14 > fib.pod_mtu:
        return Result(
            REDIRECT,
            frag_needed(frame, fib.pod_mtu),
            {},
            service=r.service,
            buckets=r.buckets,
            inbound=True,
        )
    sport, dport = struct.unpack_from("!HH", frame, 34)
    proto = frame[23]
    key = FlowKey(pod_ip, src, int(dport), int(sport), proto)
    counts = dict(r.counts)
    new_flows: set[FlowKey] = set()
    flow_vals: dict[FlowKey, FlowVal] = {}
    tcp_flags = frame[47] if proto == TCP else 0
    _record_flow(state, key, tcp_flags, now_ns, new_flows, flow_vals, counts)
    return replace(
        r,
        verdict=REDIRECT,
        counts=counts,
        new_flows=frozenset(new_flows),
        flow_vals=flow_vals,
        inbound=True,
    )


def egress(
    state: RefState,
    frame: bytes,
    now_ns: int,
    in_dev: int = 0,
    limit_ns: int | None = None,
    *,
    mono_ns: int | None = None,
    wire_len: int = 0,
    tstamp: int = 0,
) -> Result:
    """tc `cz_egress`, for a frame that entered the node by device `in_dev` (0: the node sent
    it); `limit_ns` as for `ingress`; `mono_ns`: CLOCK_MONOTONIC, the shaper's (None: now_ns).
    The skb's `wire_len` (the qdisc layer's length: a GSO packet's headers once per segment; 0:
    the frame's) is what a limit charges, never less than the frame's length; `tstamp` is its
    skb->tstamp as it comes (Result.tstamp: as it leaves)."""
    cost = max(wire_len, len(frame))
    mono = now_ns if mono_ns is None else mono_ns
    r = _egress(state, frame, now_ns, in_dev, limit_ns, mono, cost, tstamp)
    return r if r.tstamp is not None else replace(r, tstamp=tstamp)


def _egress(
    state: RefState,
    frame: bytes,
    now_ns: int,
    in_dev: int,
    limit_ns: int | None,
    mono_ns: int,
    cost: int,
    tstamp: int,
) -> Result:
    where = _locate_ip(frame)
    if where is None:
        return _untouched(frame)
    family, l3 = where
    src, dst = _src_dst(frame, family, l3)
    pod = state.pod.get(src)
    if pod is None:
        svc = state.svc.get(src)
        if state.shaped and svc is not None and l3 == 14:
            return _shape_lb(state, frame, svc, cost, mono_ns, tstamp)
        if state.to_lb is not None and family == 4 and l3 == 14 and dst in state.svc:
            return _to_lb(state, state.to_lb, frame, now_ns, limit_ns)
        return _untouched(frame)
    service = pod.service
    p = _parse_ip(frame, family, l3)
    if p is None or not _l4_fits(frame, p):
        return _counted(frame, DROP, "drop_malformed", service)
    # Source verification, once the headers are known good: a spoofed packet is dropped as it is
    # and records nothing. A confirmed device is cached, whichever path decided the frame (the
    # entry program hands a frame from another device to the full path, which asks the FIB); a
    # dry run, which the model does not make, caches nothing (docs/datapath-semantics.md).
    spoof, confirmed = spoofed(state, src, in_dev)
    if spoof:
        return _counted(frame, DROP, "drop_spoofed", service)
    devs = {src: confirmed} if confirmed is not None else {}
    icmp_type = p.icmp_type(frame)
    inner = _inner(frame, p) if icmp_type in ICMP_ERRORS[family] else None
    inner_new = pod.lb_ip if inner is not None and inner.dst == src else None
    out = _translate(frame, p, "src", pod.lb_ip, inner, inner_new)
    buckets: dict[str, Tats] = {}
    departs = tstamp
    if pod.flags & LIMIT:
        # policed, or shaped (the uplink's egress is the hook in front of fq): a refused frame
        # (beyond the shaper's horizon) is not translated and records no flow (Reading: the
        # device confirmed before stays cached)
        if state.shaped:
            admitted, buckets, departs = shape(state, service, cost, mono_ns, tstamp)
        else:
            at = now_ns if limit_ns is None else limit_ns
            admitted, buckets = police(state, service, True, cost, at)
        if not admitted:
            counts = {"drop_limit": (1, len(frame))}
            return Result(DROP, frame, counts, devs=devs, service=service, limit_frame=out)
    counts = {"nat_egress": (1, len(frame))}
    new_flows: set[FlowKey] = set()
    flow_vals: dict[FlowKey, FlowVal] = {}
    # a port-filter pod's flows, and a restricted pod's (whole-IP too), so that replies pass
    if (pod.flags & PORT_FILTER or src in state.ranges) and p.has_l4:
        key = None
        if p.proto in PORT_PROTOS:
            sport, dport = _ports(frame, p)
            key = FlowKey(src, dst, sport, dport, p.proto)
        elif icmp_type == ECHO_REQUEST[family]:
            key = FlowKey(src, dst, _echo_id(frame, p.l4), 0, p.proto)
        if key is not None:
            tcp_flags = frame[p.l4 + 13] if p.proto == TCP else 0
            _record_flow(state, key, tcp_flags, now_ns, new_flows, flow_vals, counts)
    return Result(
        PASS,
        out,
        counts,
        frozenset(new_flows),
        flow_vals=flow_vals,
        devs=devs,
        service=service,
        buckets=buckets,
        tstamp=departs,
    )
