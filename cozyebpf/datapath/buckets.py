"""The buckets that enforce a Service's limits (issue 38; bpf/lib/limit.h does the same integer
arithmetic in the programs, and the differential test holds them to this), and their place in
the `limits` map.

The buckets are GCRA (the "virtual scheduling" form of a token bucket: one 64-bit time per
bucket instead of tokens and a last refill): a packet of cost c (bytes, or 1 packet) at time
`now` is admitted when `max(tat, now) + c * unit <= now + tolerance`, and then `tat` moves to
`max(tat, now) + c * unit`, where `unit` is the time one byte (or packet) takes at the rate and
`tolerance` the burst's. It admits what a token bucket of depth `burst` and fill `rate` admits,
and needs no division per packet: `unit` is computed when the limit is set, in 2^-16 ns
(`UNIT_SHIFT`), and a packet's time is rounded down to whole nanoseconds (`tat` and the
kernel's clock are nanoseconds: a clock in 2^-16 ns would overflow 64 bits after 3.3 days of
uptime). Rounding down never drops traffic that keeps to the rate (rounding up would: each
packet charged up to 1 ns more, a stream at the rate drifts into the drop); it admits at most
1 ns per packet more than the rate: 0.8 % at 100 Gbit/s in 1,500-byte packets, 0.02 % at
1 Gbit/s in 64-byte ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from cozyebpf.datapath import kernel
from cozyebpf.datapath.flows import coarse_now_ns
from cozyebpf.datapath.layout import Gcra, LimitVal
from cozyebpf.state import Limits

#: the fixed point of a bucket's unit: 2^-16 ns (CZ_UNIT_SHIFT)
UNIT_SHIFT = 16
NS = 1_000_000_000
#: how long a burst may last at the rate (the bucket's depth), and the least depth. A flow that
#: overshoots the bucket loses its window's tail and waits a retransmission timeout, at least
#: 200 ms (Linux's minimum RTO), during which the bucket refills only up to its depth: a depth
#: of 50 ms gave a single TCP flow a quarter of its limit (the accuracy bench, bench/README.md),
#: 250 ms (the RTO and a margin) gives it the limit (1.03x at 10M, 1.05x at 100M, 0.96x at 1G
#: in the same bench). BURST_MIN_BYTES: a GSO packet's and a jumbo frame's worth at low rates
#: (a packet whose charge exceeds the burst still passes a full bucket: Bucket.admit).
BURST_TIME_NS = 250_000_000
BURST_MIN_BYTES = 64 * 1024
BURST_MIN_PACKETS = 64
#: how far ahead of the clock a bucket's time may lie and still be that clock's (CZ_AHEAD_MAX_NS,
#: 2^48 ns, 3.3 days): one further ahead was written on the other clock the programs may read
#: (jiffies times the tick's length, or the coarse clock: 50 to 500 days apart), and is full.
#: The lowest rates' buckets run minutes ahead at most (64 KiB at 1 kbit/s: 524 s).
AHEAD_MAX_NS = 1 << 48
#: fq's horizon (TCA_FQ_HORIZON's default, 10 s; CZ_FQ_HORIZON_NS): fq drops a packet whose
#: departure time lies further ahead. The shaper refuses such a packet itself (drop_limit), as
#: it does one beyond its burst's time (below 52 kbit/s the burst's time is the longer).
FQ_HORIZON_NS = 10 * NS


@dataclass(frozen=True)
class Bucket:
    """What a bucket needs, as the programs read it: `unit`, the time of one byte (or packet)
    at the rate in 2^-16 ns, and `tolerance`, the burst's time in ns."""

    unit: int
    tolerance: int

    @classmethod
    def bytes_per_second(cls, bits: int, burst_bytes: int | None = None) -> Bucket:
        """A bucket of `bits` per second; its depth `burst_bytes`, else `default_burst_bytes`."""
        burst = burst_bytes if burst_bytes is not None else default_burst_bytes(bits)
        # at least 1: a unit of 0 means "no limit" to the programs, and above 524 Tbit/s a
        # byte takes less than 2^-16 ns (such a limit holds at 524 Tbit/s: no NIC reaches it)
        return cls(max(1, (8 * NS << UNIT_SHIFT) // bits), 8 * NS * burst // bits)

    @classmethod
    def packets_per_second(cls, rate: int, burst_packets: int | None = None) -> Bucket:
        """A bucket of `rate` packets per second; its depth `burst_packets`, else
        `default_burst_packets`."""
        burst = burst_packets if burst_packets is not None else default_burst_packets(rate)
        return cls(max(1, (NS << UNIT_SHIFT) // rate), NS * burst // rate)

    def cost_ns(self, cost: int) -> int:
        """A packet's time in ns: `cost` bytes (or packets) at the rate, rounded down."""
        return (cost * self.unit) >> UNIT_SHIFT

    def admit(self, tat: int, now_ns: int, cost: int) -> tuple[bool, int]:
        """(admitted, the bucket's new time) for a packet of `cost` at `now_ns`, from the
        bucket's time `tat` (ns; 0 for a new bucket: full). A full bucket (its time not ahead
        of the clock, or further ahead than AHEAD_MAX_NS: another clock's) admits any one
        packet, and its time moves by the packet's cost, past the tolerance if the cost is
        (debt). Integer arithmetic only, as the programs do it."""
        busy = now_ns < tat <= now_ns + AHEAD_MAX_NS
        end = (tat if busy else now_ns) + self.cost_ns(cost)
        if busy and end - now_ns > self.tolerance:
            return False, tat
        return True, end

    def admit_shaped(self, edt: int, now_ns: int, cost: int) -> tuple[bool, int]:
        """The shaper's admit (bpf/lib/limit.h, cz_shape) on its next departure `edt` (ns of
        CLOCK_MONOTONIC): as `admit`, and a packet that would depart more than fq's horizon
        (FQ_HORIZON_NS) ahead is refused too (fq would drop it: at 1 kbit/s the burst's time
        is 524 s)."""
        admitted, end = self.admit(edt, now_ns, cost)
        if admitted and now_ns + FQ_HORIZON_NS < edt <= now_ns + AHEAD_MAX_NS:
            return False, edt
        return admitted, end

    def left(self, tat: int, now_ns: int, horizon: int | None = None) -> float:
        """The share of the burst left (1.0 full, 0.0 empty or in debt) of a bucket whose time
        is `tat` at `now_ns`; a shaper's against its horizon (`horizon`: FQ_HORIZON_NS), where
        that is shorter than the burst's time."""
        if not now_ns < tat <= now_ns + AHEAD_MAX_NS:
            return 1.0
        room = min(self.tolerance, horizon) if horizon is not None else self.tolerance
        return max(0.0, 1.0 - (tat - now_ns) / (room or 1))


def default_burst_bytes(bits: int) -> int:
    """BURST_TIME_NS of the rate, at least BURST_MIN_BYTES."""
    return max(bits // 8 * BURST_TIME_NS // NS, BURST_MIN_BYTES)


def default_burst_packets(rate: int) -> int:
    """BURST_TIME_NS of the rate, at least BURST_MIN_PACKETS."""
    return max(rate * BURST_TIME_NS // NS, BURST_MIN_PACKETS)


def limit_clock_ns() -> int | None:
    """Now on the programs' clock for the buckets (bpf/lib/limit.h: jiffies times the tick's
    length where the kernel's tick rate is known, else the coarse monotonic clock); None where
    the tick rate is known but jiffies cannot be read here (/proc/timer_list is root's)."""
    if kernel.hz() is None:
        return coarse_now_ns()
    return kernel.jiffies_ns()


def limit_val(limits: Limits) -> LimitVal:
    """The `limits` map's value of a Service's limits: a bucket of each kind it has (unit 0:
    none), the rates as asked (what user space reads back), and whether the packet rate is the
    node's guard."""
    v = LimitVal()
    if limits.ingress_bps is not None:
        b = Bucket.bytes_per_second(limits.ingress_bps)
        v.in_bytes, v.rates[0] = Gcra(b.unit, b.tolerance), limits.ingress_bps
    if limits.ingress_pps is not None:
        b = Bucket.packets_per_second(limits.ingress_pps)
        v.in_pkts, v.rates[1] = Gcra(b.unit, b.tolerance), limits.ingress_pps
    if limits.egress_bps is not None:
        b = Bucket.bytes_per_second(limits.egress_bps)
        v.out_bytes, v.rates[2] = Gcra(b.unit, b.tolerance), limits.egress_bps
    v.guard = int(limits.guard)
    return v


def limits_of(v: LimitVal) -> Limits:
    """The Limits a `limits` value holds (its rates; 0: none)."""
    rate = [int(r) or None for r in v.rates]
    return Limits(rate[0], rate[2], rate[1], bool(v.guard))


def buckets_of(limits: Limits) -> dict[str, Bucket]:
    """Each bucket of `limits`, by the name `maps dump` and the metrics give it."""
    out: dict[str, Bucket] = {}
    if limits.ingress_bps is not None:
        out["ingress_bytes"] = Bucket.bytes_per_second(limits.ingress_bps)
    if limits.ingress_pps is not None:
        out["ingress_packets"] = Bucket.packets_per_second(limits.ingress_pps)
    if limits.egress_bps is not None:
        out["egress_bytes"] = Bucket.bytes_per_second(limits.egress_bps)
    return out
