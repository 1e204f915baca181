"""The buckets' arithmetic in the programs against cozyebpf/datapath/buckets.py, with
BPF_PROG_RUN (issue 38): for each program that enforces a limit (XDP and tc ingress, the
uplink's egress) and each of its paths (the fast one; the full one, for a frame with a VLAN tag),
a packet that a bucket admits moves the bucket's time by exactly Bucket.cost_ns of its cost,
one the bucket refuses is dropped as drop_limit and moves nothing, and two buckets are charged
both or neither. The buckets are set busy (their time ahead of the programs' clock,
limit_clock_ns), where GCRA does not depend on when the packet runs: the result is exact.
A GSO packet out (the skb's wire_len and gso_segs, set in the context) is charged its headers
once per segment.
Shaped egress (the uplinks have fq): the packet leaves at the shaper's next departure time
(skb->tstamp, read back from the context), which moves by its cost, from the pod's packet the
uplink translates and from an LB IP's packet the pod-facing hook translated; beyond the horizon
it is dropped; the policer's bucket is not touched."""

from __future__ import annotations

import ctypes
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from ipaddress import ip_address

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Packet

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.buckets import AHEAD_MAX_NS, FQ_HORIZON_NS, Bucket, limit_clock_ns
from cozyebpf.datapath.layout import BucketVal
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.state import Limits, MapDiff, MapState, PodEntry, ServiceEntry, diff
from tests.support.packets import (
    CLIENT,
    LB_FILT,
    LB_WHOLE,
    MAC_A,
    MAC_B,
    POD_FILT,
    POD_WHOLE,
)

#: struct __sk_buff: its size, and the offsets of tstamp and wire_len (gso_segs follows it)
SKB_SIZE, SKB_TSTAMP, SKB_WIRE_LEN = 192, 152, 160
XDP_DROP, XDP_PASS = 1, 2
TC_NEXT, TC_SHOT = -1, 2
VM = "default/vm1"
#: the lowest rates: bursts of seconds, so that a bucket set 10 s ahead still admits
LIMITS = Limits(ingress_bps=1_000, egress_bps=1_000, ingress_pps=1)
AHEAD = 10 * 10**9


def clock() -> int:
    now = limit_clock_ns()
    assert now is not None, "the limits' clock cannot be read (run as root)"
    return now


@dataclass
class Progs:
    maps: PinnedMaps
    fds: dict[str, int]

    def run(self, prog: str, frame: Packet) -> int:
        return bpfsys.prog_test_run(self.fds[prog], bytes(frame)).retval

    def run_skb(
        self, prog: str, frame: Packet, gso_segs: int = 0, wire_len: int = 0
    ) -> tuple[int, int]:
        """A tc program on `frame` as an skb of `gso_segs` segments and the qdisc layer's
        length `wire_len` (0: the frame's): (verdict, skb->tstamp as the program left it)."""
        ctx = bytearray(SKB_SIZE)
        struct.pack_into("=II", ctx, SKB_WIRE_LEN, wire_len, gso_segs)
        r = bpfsys.prog_test_run(self.fds[prog], bytes(frame), ctx=bytes(ctx), ctx_out=SKB_SIZE)
        return r.retval, struct.unpack_from("=Q", r.ctx, SKB_TSTAMP)[0]

    def key(self) -> ctypes.c_uint32:
        slot = self.maps.slots.slot(VM)
        assert slot, "vm1 has no slot"
        return ctypes.c_uint32(slot)

    def buckets(self) -> BucketVal:
        v = BucketVal()
        assert bpfsys.map_lookup(self.maps.fds["buckets"], self.key(), v)
        return v

    def set_buckets(self, in_bytes: int, in_pkts: int, out_bytes: int, out_edt: int = 0) -> None:
        v = BucketVal(in_bytes=in_bytes, in_pkts=in_pkts, out_bytes=out_bytes, out_edt=out_edt)
        bpfsys.map_update(self.maps.fds["buckets"], self.key(), v)

    def drops(self) -> int:
        return self.maps.counters()["drop_limit"]["packets"]


def state(limits: Limits) -> MapState:
    """vm1 (whole IP) with `limits`, and vm2 without."""
    st = MapState()
    lb, pod = ip_address(LB_WHOLE), ip_address(POD_WHOLE)
    st.services[lb] = ServiceEntry(pod, False, False, VM, limited=True)
    st.pods[pod] = PodEntry(lb, False, False, VM, limited=True)
    st.limits[VM] = limits
    # another VM's LB IP, without limits: a destination the uplink's to_lb path sees
    lb2, pod2 = ip_address(LB_FILT), ip_address(POD_FILT)
    st.services[lb2] = ServiceEntry(pod2, False, False, "default/vm2")
    st.pods[pod2] = PodEntry(lb2, False, False, "default/vm2")
    return st


@pytest.fixture(scope="module")
def p() -> Iterator[Progs]:
    from cozyebpf.datapath.attach import detach_all
    from tests.support.env import unique_prefix
    from tests.support.labtools import load_programs

    pin = f"/sys/fs/bpf/{unique_prefix('lim')}"
    maps = PinnedMaps.ensure(pin, max_services=2)
    try:
        loaded = load_programs(pin)
        maps.apply(diff(maps.read_state(), state(LIMITS)))
        yield Progs(maps, {k: prog.fd for k, prog in loaded.items()})
    finally:
        maps.close()
        detach_all(pin)


def to_lb(tag: bool) -> Packet:
    eth = Ether(src=MAC_A, dst=MAC_B)
    if tag:
        eth = eth / Dot1Q(vlan=5)
    return eth / IP(src=CLIENT, dst=LB_WHOLE) / UDP(sport=1000, dport=53) / (b"x" * 100)


def from_pod(tag: bool) -> Packet:
    eth = Ether(src=MAC_A, dst=MAC_B)
    if tag:
        eth = eth / Dot1Q(vlan=5)
    return eth / IP(src=POD_WHOLE, dst=CLIENT) / UDP(sport=53, dport=1000) / (b"y" * 300)


BYTES_IN = Bucket.bytes_per_second(1_000)
PKTS_IN = Bucket.packets_per_second(1)
BYTES_OUT = Bucket.bytes_per_second(1_000)

INGRESS = [
    ("xdp", False, XDP_PASS, XDP_DROP),
    ("xdp", True, XDP_PASS, XDP_DROP),
    ("tc", False, TC_NEXT, TC_SHOT),
    ("tc", True, TC_NEXT, TC_SHOT),
]
IDS = ["xdp-fast", "xdp-full", "tc-fast", "tc-full"]


@pytest.mark.parametrize(("prog", "tag", "passes", "drops"), INGRESS, ids=IDS)
def test_an_admitted_packet_moves_each_ingress_bucket_by_its_cost(
    p: Progs, prog: str, tag: bool, passes: int, drops: int
) -> None:
    now = clock()
    p.set_buckets(now + AHEAD, now + AHEAD, 0)
    frame = to_lb(tag)
    assert p.run(prog, frame) == passes
    b = p.buckets()
    assert b.in_bytes == now + AHEAD + BYTES_IN.cost_ns(len(bytes(frame)))
    assert b.in_pkts == now + AHEAD + PKTS_IN.cost_ns(1)
    assert b.out_bytes == 0


@pytest.mark.parametrize(("prog", "tag", "passes", "drops"), INGRESS, ids=IDS)
def test_a_refused_packet_is_dropped_and_charges_neither_bucket(
    p: Progs, prog: str, tag: bool, passes: int, drops: int
) -> None:
    now = clock()
    full = now + PKTS_IN.tolerance + 10**9  # the packet bucket refuses; the byte one would not
    p.set_buckets(now + AHEAD, full, 0)
    before = p.drops()
    assert p.run(prog, to_lb(tag)) == drops
    assert p.drops() == before + 1
    b = p.buckets()
    assert (b.in_bytes, b.in_pkts) == (now + AHEAD, full)


@pytest.mark.parametrize("tag", [False, True], ids=["fast", "full"])
def test_egress_moves_its_bucket_by_the_frames_bytes_and_refuses_over_it(
    p: Progs, tag: bool
) -> None:
    now = clock()
    p.set_buckets(0, 0, now + AHEAD)
    frame = from_pod(tag)
    assert p.run("egress", frame) == TC_NEXT
    assert p.buckets().out_bytes == now + AHEAD + BYTES_OUT.cost_ns(len(bytes(frame)))
    over = now + BYTES_OUT.tolerance + 10**9
    p.set_buckets(0, 0, over)
    before = p.drops()
    assert p.run("egress", from_pod(tag)) == TC_SHOT
    assert p.drops() == before + 1
    assert p.buckets().out_bytes == over
    assert (p.buckets().in_bytes, p.buckets().in_pkts) == (0, 0)  # ingress's untouched


def test_an_idle_bucket_starts_at_the_clock() -> None:
    """What Bucket.admit says of a bucket whose time is behind the clock (0: a new one): it
    starts at `now`, the rule the programs' compare-and-exchange follows."""
    ok, tat = PKTS_IN.admit(0, 5 * 10**9, 1)
    assert ok and tat == 5 * 10**9 + PKTS_IN.cost_ns(1)


def tcp_from(src: str, tag: bool = False, dst: str = CLIENT) -> Packet:
    """A TCP segment of 1,000 bytes from `src` to `dst` (the client), with 12 bytes of options
    (a TCP header of 32: what the per-segment charge must read from the data offset)."""
    eth = Ether(src=MAC_A, dst=MAC_B)
    if tag:
        eth = eth / Dot1Q(vlan=5)
    opts = [("NOP", None), ("NOP", None), ("Timestamp", (1, 2))]
    return eth / IP(src=src, dst=dst) / TCP(sport=22, dport=40000, options=opts) / (b"t" * 1000)


#: the headers each segment of tcp_from's frame carries on the wire: Ethernet, IPv4, TCP
TCP_HEADERS = 14 + 20 + 32


def wire(frame: Packet, segs: int) -> int:
    """What `frame` as a GSO packet of `segs` segments puts on the wire (the kernel's
    qdisc_pkt_len_init): its headers once per segment."""
    return len(bytes(frame)) + (segs - 1) * TCP_HEADERS


@pytest.mark.parametrize("segs", [2, 45])
def test_a_gso_packet_is_charged_its_headers_once_per_segment(p: Progs, segs: int) -> None:
    """Egress charges a GSO packet what the qdisc layer counts (the skb's wire_len: its headers
    once per segment; the kernel sets it before the egress hook), on the fast and the full
    path. tc ingress (a GRO packet; where wire_len is its length) counts the segments' headers
    itself on the fast path (its TCP data offset), and charges the segments to the packet
    bucket; its full path (a VLAN tag) charges the length. One segment: its length (the tests
    above)."""
    now = clock()
    for tag in (False, True):
        p.set_buckets(now + AHEAD, now + AHEAD, now + AHEAD)
        out = tcp_from(POD_WHOLE, tag)
        assert p.run_skb("egress", out, segs, wire(out, segs))[0] == TC_NEXT
        assert p.buckets().out_bytes == now + AHEAD + BYTES_OUT.cost_ns(wire(out, segs))
    for tag in (False, True):
        p.set_buckets(now + AHEAD, now + AHEAD, now + AHEAD)
        eth = Ether(src=MAC_A, dst=MAC_B)
        eth = eth / Dot1Q(vlan=5) if tag else eth
        frame = eth / IP(src=CLIENT, dst=LB_WHOLE) / tcp_from(POD_WHOLE)[TCP]
        n = len(bytes(frame))
        assert p.run_skb("tc", frame, segs, n)[0] == TC_NEXT
        b = p.buckets()
        assert b.in_bytes == now + AHEAD + BYTES_IN.cost_ns(n if tag else wire(frame, segs))
        assert b.in_pkts == now + AHEAD + PKTS_IN.cost_ns(segs)


@pytest.fixture
def shaped(p: Progs) -> Iterator[Progs]:
    """Egress shaped (the agent's decision where every uplink's root qdisc is fq)."""
    p.maps.set_shaped(True)
    try:
        yield p
    finally:
        p.maps.set_shaped(False)


SHAPED = [
    (POD_WHOLE, False, CLIENT),
    (POD_WHOLE, True, CLIENT),
    (LB_WHOLE, False, CLIENT),
    (LB_WHOLE, False, LB_FILT),
]
SHAPED_IDS = ["pod-fast", "pod-full", "from-lb-ip", "from-lb-ip-to-an-lb-ip"]


@pytest.mark.parametrize(("src", "tag", "dst"), SHAPED, ids=SHAPED_IDS)
def test_shaped_egress_sets_the_departure_time_and_moves_it_by_the_cost(
    shaped: Progs, src: str, tag: bool, dst: str
) -> None:
    """A busy shaper (its next departure ahead of the monotonic clock, fq's): the packet gets
    that departure as skb->tstamp and passes; the departure moves by its cost (3 segments: its
    headers three times); the policer's bucket stays as it was. From the pod IP the uplink
    translates it (fast and full path); from the LB IP (translated by the pod-facing hook) it is
    shaped untouched, to the client and to another VM's LB IP (the uplink's to_lb path)."""
    p = shaped
    t = time.monotonic_ns() + 10**9  # a second ahead: well inside the burst of 1 kbit/s
    p.set_buckets(0, 0, 7, t)
    frame = tcp_from(src, tag, dst)
    verdict, tstamp = p.run_skb("egress", frame, 3, wire(frame, 3))
    assert verdict == TC_NEXT
    assert tstamp == t
    b = p.buckets()
    assert b.out_edt == t + BYTES_OUT.cost_ns(wire(frame, 3))
    assert b.out_bytes == 7


@pytest.mark.parametrize(("src", "tag", "dst"), SHAPED, ids=SHAPED_IDS)
def test_shaped_egress_drops_beyond_the_horizon(
    shaped: Progs, src: str, tag: bool, dst: str
) -> None:
    """A departure more than the burst's time ahead: dropped as drop_limit, nothing moved."""
    p = shaped
    t = time.monotonic_ns() + BYTES_OUT.tolerance + 10**9
    p.set_buckets(0, 0, 0, t)
    before = p.drops()
    assert p.run_skb("egress", tcp_from(src, tag, dst))[0] == TC_SHOT
    assert p.drops() == before + 1
    assert p.buckets().out_edt == t


def test_policed_egress_leaves_the_departure_time_and_an_lb_ip_packet_alone(p: Progs) -> None:
    """Not shaped: the pod's packet is policed (its bucket moves, no departure time is set);
    a packet from the LB IP is not the uplink's to limit."""
    now, t = clock(), time.monotonic_ns() + 10**9
    p.set_buckets(0, 0, now + AHEAD, t)
    frame = tcp_from(POD_WHOLE)
    assert p.run_skb("egress", frame) == (TC_NEXT, 0)
    assert p.buckets().out_bytes == now + AHEAD + BYTES_OUT.cost_ns(len(bytes(frame)))
    assert p.run_skb("egress", tcp_from(LB_WHOLE)) == (TC_NEXT, 0)
    assert p.run_skb("egress", tcp_from(LB_WHOLE, dst=LB_FILT)) == (TC_NEXT, 0)
    assert p.buckets().out_edt == t


#: how far the other clock the programs may read runs ahead: jiffies times the tick's length
#: starts 2^32 - 300 * HZ ticks ahead of the coarse clock (the least: HZ 1000, 49.7 days)
OTHER_CLOCK = (2**32 - 300 * 1000) * 10**6


def bounds(before: int, after: int, cost_ns: int) -> range:
    """The times a full bucket reaches: its cost from the clock the program read."""
    return range(before + cost_ns, after + cost_ns + 1)


@pytest.mark.parametrize(("prog", "tag", "passes", "drops"), INGRESS, ids=IDS)
def test_a_bucket_written_on_the_other_clock_is_full(
    p: Progs, prog: str, tag: bool, passes: int, drops: int
) -> None:
    """Buckets are pinned, the clock that wrote them is not: an agent that picked the other
    clock (jiffies times the tick's length, or the coarse clock: 50 to 500 days apart) finds
    them far ahead of its own. Further ahead than AHEAD_MAX_NS they are full (the packet
    passes and starts them at the clock); short of it they are this clock's (refused)."""
    before = clock()
    p.set_buckets(before + OTHER_CLOCK, before + OTHER_CLOCK, 0)
    frame = to_lb(tag)
    assert p.run(prog, frame) == passes
    after = clock()
    b = p.buckets()
    assert b.in_bytes in bounds(before, after, BYTES_IN.cost_ns(len(bytes(frame))))
    assert b.in_pkts in bounds(before, after, PKTS_IN.cost_ns(1))
    ours = clock() + AHEAD_MAX_NS - 10**12  # 1,000 s short of the bound: this clock's, empty
    p.set_buckets(ours, ours, 0)
    assert p.run(prog, frame) == drops
    assert (p.buckets().in_bytes, p.buckets().in_pkts) == (ours, ours)


@pytest.mark.parametrize("tag", [False, True], ids=["fast", "full"])
def test_an_egress_bucket_written_on_the_other_clock_is_full(p: Progs, tag: bool) -> None:
    """The same for the egress policer's bucket."""
    before = clock()
    p.set_buckets(0, 0, before + OTHER_CLOCK)
    frame = from_pod(tag)
    assert p.run("egress", frame) == TC_NEXT
    after = clock()
    assert p.buckets().out_bytes in bounds(before, after, BYTES_OUT.cost_ns(len(bytes(frame))))


@pytest.mark.parametrize("tag", [False, True], ids=["fast", "full"])
def test_a_full_bucket_passes_one_packet_over_its_burst(p: Progs, tag: bool) -> None:
    """The least burst (64 packets, 64 KiB) is less than what one packet may be charged: here a
    GRO packet of 100 segments into tc ingress at 1 packet/s (a 64 KiB TSO packet's 68 KB out:
    test_limits.py, whose UDP GSO packets go through real veths; BPF_PROG_RUN takes no wire
    length above 64 KiB). From a full bucket it passes and the bucket goes into debt by its
    cost (the rate holds: the next packet is refused)."""
    eth = Ether(src=MAC_A, dst=MAC_B)
    eth = eth / Dot1Q(vlan=5) if tag else eth
    frame = eth / IP(src=CLIENT, dst=LB_WHOLE) / tcp_from(POD_WHOLE)[TCP]
    segs = 100
    assert PKTS_IN.cost_ns(segs) > PKTS_IN.tolerance  # more packets than the burst
    before = clock()
    p.set_buckets(0, 0, 0)
    assert p.run_skb("tc", frame, segs, len(bytes(frame)))[0] == TC_NEXT
    after = clock()
    assert p.buckets().in_pkts in bounds(before, after, PKTS_IN.cost_ns(segs))
    assert p.run_skb("tc", frame)[0] == TC_SHOT  # in debt


def test_the_shaper_drops_beyond_fqs_horizon(shaped: Progs) -> None:
    """fq drops a packet whose departure time is more than its horizon (10 s) ahead; at
    1 kbit/s the burst's time is 524 s. A departure 20 s ahead is the shaper's drop_limit
    (nothing moved), one 9 s ahead leaves then."""
    p = shaped
    assert BYTES_OUT.tolerance > 30 * 10**9 and FQ_HORIZON_NS == 10 * 10**9
    t = time.monotonic_ns() + 20 * 10**9
    p.set_buckets(0, 0, 0, t)
    before = p.drops()
    frame = tcp_from(POD_WHOLE)
    assert p.run_skb("egress", frame)[0] == TC_SHOT
    assert p.drops() == before + 1 and p.buckets().out_edt == t
    t = time.monotonic_ns() + 9 * 10**9
    p.set_buckets(0, 0, 0, t)
    assert p.run_skb("egress", frame) == (TC_NEXT, t)
    assert p.buckets().out_edt == t + BYTES_OUT.cost_ns(len(bytes(frame)))


def test_maps_show_the_shapers_state_while_shaped(p: Progs) -> None:
    """`status` and `maps dump` (PinnedMaps.limits) show the egress bucket the programs use:
    the policer's (out_bytes) when policed, the shaper's (out_edt, on the monotonic clock,
    against its horizon: 10 s at 1 kbit/s) when shaped."""
    p.set_buckets(0, 0, 0, time.monotonic_ns() + 5 * 10**9)
    assert p.maps.limits()[VM][1]["egress_bytes"] == 1.0  # policed: out_bytes, full
    p.maps.set_shaped(True)
    try:
        left = p.maps.limits()[VM][1]["egress_bytes"]
    finally:
        p.maps.set_shaped(False)
    assert 0.45 < left < 0.55, left


def test_a_changed_limit_starts_its_buckets_full(p: Progs) -> None:
    """A bucket's time was charged at its limit's rate: a raised 1 packet/s limit that a flood
    emptied would refuse for up to 64 s more. A changed limit starts its own buckets full (the
    egress one: the policer's and the shaper's); the others are left as they were, and an apply
    that leaves the limits as they are (an agent's restart) touches no bucket."""
    now, mono = clock(), time.monotonic_ns()
    empty = (now + PKTS_IN.tolerance, now + PKTS_IN.tolerance, now + BYTES_OUT.tolerance)
    try:
        p.set_buckets(*empty, mono + 10**9)
        p.maps.apply(MapDiff(limits_set={VM: LIMITS}))  # the same limits, written again
        b = p.buckets()
        assert (b.in_bytes, b.in_pkts, b.out_bytes, b.out_edt) == (*empty, mono + 10**9)
        assert p.run("xdp", to_lb(False)) == XDP_DROP
        raised = Limits(ingress_bps=1_000, egress_bps=1_000, ingress_pps=1_000)
        p.maps.apply(diff(p.maps.read_state(), state(raised)))
        b = p.buckets()
        assert (b.in_bytes, b.in_pkts, b.out_bytes, b.out_edt) == (
            empty[0],
            0,
            empty[2],
            mono + 10**9,
        )
        assert p.run("xdp", to_lb(False)) == XDP_PASS  # at once
        p.maps.apply(diff(p.maps.read_state(), state(replace(raised, egress_bps=2_000))))
        b = p.buckets()
        assert (b.out_bytes, b.out_edt) == (0, 0) and b.in_pkts != 0
    finally:
        p.maps.apply(diff(p.maps.read_state(), state(LIMITS)))
