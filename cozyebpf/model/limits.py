"""Limits per public IP (issue 38): what a Service's annotations ask for, and the arithmetic of
the buckets that enforce them, written once here for the agent, the differential model and the
tests (the programs in bpf/ do the same integer arithmetic).

- `networking.cozystack.io/ingressBandwidth` and `.../egressBandwidth`: bits per second, in
  the syntax the kubelet reads `kubernetes.io/ingress-bandwidth` with (a Kubernetes quantity:
  `100M`, `1G`, `2.5G`, `10Mi`, `1e9`), and the kubelet's bounds: at least 1k, at most 1P
  (pkg/util/bandwidth: "unreasonably small (< 1kbit)", "unreasonably large (> 1Pbit)").
- `networking.cozystack.io/ingressPacketRate`: packets per second, the same syntax (`50000`,
  `100k`), at least 1, at most 1G.

A bad value never fails the Service: the caller programs it without that limit and says why
(`LimitError`'s text names the annotation, the value and the fix).

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

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

ANN_INGRESS_BANDWIDTH = "networking.cozystack.io/ingressBandwidth"
ANN_EGRESS_BANDWIDTH = "networking.cozystack.io/egressBandwidth"
ANN_INGRESS_PACKET_RATE = "networking.cozystack.io/ingressPacketRate"

#: the kubelet's bounds for kubernetes.io/{ingress,egress}-bandwidth, in bits per second
BANDWIDTH_MIN = 1_000
BANDWIDTH_MAX = 10**15
PACKET_RATE_MIN = 1
PACKET_RATE_MAX = 10**9

#: the fixed point of a bucket's unit: 2^-16 ns
UNIT_SHIFT = 16
NS = 1_000_000_000

#: how long a burst may last at the rate (the bucket's depth), and the least depth: a policer
#: shallower than a TCP window's worth of the rate drops a window's tail at every round trip
#: and TCP never reaches the rate; BURST_TIME_NS of the rate covers the round trips of a
#: region (Europe's, North America's), BURST_MIN_BYTES a jumbo frame's and a GSO segment's
#: worth at low rates. The accuracy benchmark (bench/) holds them to TCP's goodput.
BURST_TIME_NS = 50_000_000
BURST_MIN_BYTES = 64 * 1024
BURST_MIN_PACKETS = 64

_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"^\+?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:([eE][+-]?[0-9]+)|([kMGTPE]i?))?$")


class LimitError(ValueError):
    """A limit annotation's value that cannot be used; str() says what and how to fix it."""


def parse_quantity(text: str) -> int:
    """A Kubernetes quantity (`100M`, `1.5G`, `10Mi`, `1e6`) as an integer, rounded up as
    resource.Quantity.Value() rounds (a fraction of a bit per second is one more). ValueError
    when it is not one; milli-units (`500m`) are not accepted: no rate here is a fraction."""
    m = _QUANTITY.match(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a quantity")
    number, exponent, suffix = m.groups()
    try:
        value = Decimal(number)
        if exponent:
            value *= Decimal(10) ** int(exponent[1:])
        value *= _SUFFIXES[suffix or ""]
    except (InvalidOperation, OverflowError) as e:
        raise ValueError(f"{text!r} is not a quantity") from e
    return math.ceil(value)


def _parse(annotation: str, text: str, lo: int, hi: int, what: str, example: str) -> int:
    try:
        value = parse_quantity(text)
    except ValueError:
        raise LimitError(
            f'annotation {annotation}: "{text}" is not a {what} (write a number with an '
            f'optional suffix k, M, G, T, P, Ki, Mi, Gi, ..., for example "{example}")'
        ) from None
    if not lo <= value <= hi:
        raise LimitError(
            f'annotation {annotation}: "{text}" is {value} {what}s per second, outside '
            f"{lo:,} to {hi:,} (set a value in that range, or remove the annotation for none)"
        )
    return value


def parse_bandwidth(annotation: str, text: str) -> int:
    """Bits per second from a bandwidth annotation's value; LimitError names it and the fix."""
    return _parse(annotation, text, BANDWIDTH_MIN, BANDWIDTH_MAX, "bit", "100M")


def parse_packet_rate(annotation: str, text: str) -> int:
    """Packets per second from a packet-rate annotation's value; LimitError as above."""
    return _parse(annotation, text, PACKET_RATE_MIN, PACKET_RATE_MAX, "packet", "100k")


@dataclass(frozen=True, slots=True)
class Limits:
    """A Service's limits as its annotations ask (None: no limit of that kind)."""

    ingress_bps: int | None = None
    egress_bps: int | None = None
    ingress_pps: int | None = None

    def __bool__(self) -> bool:
        return any(v is not None for v in (self.ingress_bps, self.egress_bps, self.ingress_pps))


NO_LIMITS = Limits()


def read_limits(annotations: Mapping[str, Any]) -> tuple[Limits, list[str]]:
    """The limits a Service's annotations ask for, and what is wrong with each bad one (that
    limit is left out; the others and the Service stand)."""
    errors: list[str] = []
    got: dict[str, int | None] = {}
    for field, annotation, parse, example in (
        ("ingress_bps", ANN_INGRESS_BANDWIDTH, parse_bandwidth, "100M"),
        ("egress_bps", ANN_EGRESS_BANDWIDTH, parse_bandwidth, "100M"),
        ("ingress_pps", ANN_INGRESS_PACKET_RATE, parse_packet_rate, "100k"),
    ):
        value = annotations.get(annotation)
        if value is None:
            continue
        if not isinstance(value, str):
            errors.append(
                f"annotation {annotation} is {value!r}, not a string: the Service has no such "
                f'limit; quote it ("{example}")'
            )
            continue
        try:
            got[field] = parse(annotation, value)
        except LimitError as e:
            errors.append(f"{e}; the Service has no such limit until it is fixed")
    return (Limits(**got) if got else NO_LIMITS), errors


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
        return cls((8 * NS << UNIT_SHIFT) // bits, 8 * NS * burst // bits)

    @classmethod
    def packets_per_second(cls, rate: int, burst_packets: int | None = None) -> Bucket:
        """A bucket of `rate` packets per second; its depth `burst_packets`, else
        `default_burst_packets`."""
        burst = burst_packets if burst_packets is not None else default_burst_packets(rate)
        return cls((NS << UNIT_SHIFT) // rate, NS * burst // rate)

    def cost_ns(self, cost: int) -> int:
        """A packet's time in ns: `cost` bytes (or packets) at the rate, rounded down."""
        return (cost * self.unit) >> UNIT_SHIFT

    def admit(self, tat: int, now_ns: int, cost: int) -> tuple[bool, int]:
        """(admitted, the bucket's new time) for a packet of `cost` at `now_ns`, from the
        bucket's time `tat` (ns; 0 for a new bucket: full). Integer arithmetic only, as the
        programs do it."""
        start = max(tat, now_ns)
        end = start + self.cost_ns(cost)
        if end - now_ns > self.tolerance:
            return False, tat
        return True, end


def default_burst_bytes(bits: int) -> int:
    """BURST_TIME_NS of the rate, at least BURST_MIN_BYTES."""
    return max(bits // 8 * BURST_TIME_NS // NS, BURST_MIN_BYTES)


def default_burst_packets(rate: int) -> int:
    """BURST_TIME_NS of the rate, at least BURST_MIN_PACKETS."""
    return max(rate * BURST_TIME_NS // NS, BURST_MIN_PACKETS)
