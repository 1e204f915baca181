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

The buckets that enforce them, and their arithmetic: cozyebpf/datapath/buckets.py (and
bpf/lib/limit.h); `Limits` itself is the state's (cozyebpf/state.py), which the datapath reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from cozyebpf.state import NO_LIMITS, Limits

ANN_INGRESS_BANDWIDTH = "networking.cozystack.io/ingressBandwidth"
ANN_EGRESS_BANDWIDTH = "networking.cozystack.io/egressBandwidth"
ANN_INGRESS_PACKET_RATE = "networking.cozystack.io/ingressPacketRate"

#: the kubelet's bounds for kubernetes.io/{ingress,egress}-bandwidth, in bits per second
BANDWIDTH_MIN = 1_000
BANDWIDTH_MAX = 10**15
PACKET_RATE_MIN = 1
PACKET_RATE_MAX = 10**9


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
    if not got:
        return NO_LIMITS, errors
    return Limits(got.get("ingress_bps"), got.get("egress_bps"), got.get("ingress_pps")), errors


def _si(value: int) -> str:
    """1500000 -> "1.5 M", 100 -> "100 " (the prefix and a space, for a unit to follow)."""
    for factor, prefix in ((10**12, "T"), (10**9, "G"), (10**6, "M"), (10**3, "k")):
        if value >= factor:
            return f"{value / factor:g} {prefix}"
    return f"{value} "


def describe(limits: Limits) -> str:
    """A Service's limits as status and explain say them: "ingress 100 Mbit/s, 50 kpackets/s
    (the node's guard); egress 1 Gbit/s", or "none"."""
    parts = []
    ingress = []
    if limits.ingress_bps is not None:
        ingress.append(f"{_si(limits.ingress_bps)}bit/s")
    if limits.ingress_pps is not None:
        guard = " (the node's guard)" if limits.guard else ""
        ingress.append(f"{_si(limits.ingress_pps)}packets/s{guard}")
    if ingress:
        parts.append("ingress " + ", ".join(ingress))
    if limits.egress_bps is not None:
        parts.append(f"egress {_si(limits.egress_bps)}bit/s")
    return "; ".join(parts) or "none"
