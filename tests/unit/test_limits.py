"""The limits' annotations (cozyebpf/model/limits.py) and the buckets' arithmetic
(cozyebpf/datapath/buckets.py), issue 38."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cozyebpf.config import RunConfig
from cozyebpf.datapath.buckets import (
    AHEAD_MAX_NS,
    BURST_MIN_BYTES,
    FQ_HORIZON_NS,
    NS,
    UNIT_SHIFT,
    Bucket,
    default_burst_bytes,
    limit_val,
    limits_of,
)
from cozyebpf.errors import PermanentError
from cozyebpf.model import ModelResult, build_state
from cozyebpf.model.limits import (
    ANN_EGRESS_BANDWIDTH,
    ANN_INGRESS_BANDWIDTH,
    ANN_INGRESS_PACKET_RATE,
    LimitError,
    parse_bandwidth,
    parse_packet_rate,
    parse_quantity,
    read_limits,
)
from cozyebpf.state import NO_LIMITS, Limits
from cozylab.k8s import Svc, objects


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100M", 100_000_000),
        ("1G", 10**9),
        ("2.5G", 2_500_000_000),
        ("10Mi", 10 * 2**20),
        ("1e9", 10**9),
        ("1.5k", 1_500),
        ("1.0001k", 1_001),  # rounded up, as resource.Quantity.Value()
        ("+50000", 50_000),
        (" 100k ", 100_000),
        (".5M", 500_000),
    ],
)
def test_quantities_as_the_kubelet_reads_them(text: str, value: int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "M", "100 M", "-5", "500m", "1Q", "1e", "1,000", "0x10"])
def test_what_is_not_a_quantity(text: str) -> None:
    with pytest.raises(ValueError, match="is not a quantity"):
        parse_quantity(text)


def test_a_bad_bandwidth_names_the_annotation_the_value_and_the_fix() -> None:
    with pytest.raises(LimitError) as e:
        parse_bandwidth(ANN_INGRESS_BANDWIDTH, "fast")
    assert str(e.value) == (
        f'annotation {ANN_INGRESS_BANDWIDTH}: "fast" is not a bit (write a number with an '
        'optional suffix k, M, G, T, P, Ki, Mi, Gi, ..., for example "100M")'
    )
    with pytest.raises(LimitError, match=r'"999" is 999 bits per second, outside 1,000 to'):
        parse_bandwidth(ANN_INGRESS_BANDWIDTH, "999")
    with pytest.raises(LimitError, match=r"outside 1,000 to 1,000,000,000,000,000 \(set a value"):
        parse_bandwidth(ANN_INGRESS_BANDWIDTH, "2P")
    assert parse_bandwidth(ANN_INGRESS_BANDWIDTH, "1k") == 1_000
    assert parse_bandwidth(ANN_INGRESS_BANDWIDTH, "1P") == 10**15


def test_packet_rates() -> None:
    assert parse_packet_rate(ANN_INGRESS_PACKET_RATE, "100k") == 100_000
    assert parse_packet_rate(ANN_INGRESS_PACKET_RATE, "50000") == 50_000
    with pytest.raises(LimitError, match=r'"0" is 0 packets per second, outside 1 to'):
        parse_packet_rate(ANN_INGRESS_PACKET_RATE, "0")
    with pytest.raises(LimitError, match=r'for example "100k"'):
        parse_packet_rate(ANN_INGRESS_PACKET_RATE, "lots")


def test_a_full_bucket_admits_its_burst_at_once_and_then_the_rate() -> None:
    b = Bucket.bytes_per_second(8_000_000, burst_bytes=10_000)  # 1 MB/s: a byte a microsecond
    tat, now = 0, 10 * NS
    for _ in range(10):
        ok, tat = b.admit(tat, now, 1_000)
        assert ok
    ok, same = b.admit(tat, now, 1)
    assert not ok and same == tat  # the burst is spent; a dropped packet costs nothing
    ok, tat = b.admit(tat, now + 1_000_000, 1_000)  # 1 ms later: 1,000 bytes more
    assert ok
    assert not b.admit(tat, now + 1_000_000, 1)[0]


def test_a_full_bucket_passes_one_packet_over_its_burst_into_debt() -> None:
    """The least burst (64 KiB) is less than a 64 KiB TSO packet's charge (68 KB with its
    headers per segment): a full bucket passes it, and the bucket's time runs its cost ahead
    (debt) until the rate has paid what exceeds the burst; a busy bucket refuses it."""
    b = Bucket.bytes_per_second(1_000_000)
    assert b.tolerance == b.cost_ns(BURST_MIN_BYTES)
    now, cost = 5 * NS, 68_440
    ok, tat = b.admit(0, now, cost)
    assert ok and tat == now + b.cost_ns(cost) > now + b.tolerance
    assert not b.admit(tat, now, 64)[0]  # in debt
    later = tat - b.tolerance + b.cost_ns(64)
    assert b.admit(tat, later, 64) == (True, tat + b.cost_ns(64))  # paid: the rate again
    assert not b.admit(now + 1, now, cost)[0]  # not full: refused


def test_a_bucket_far_ahead_is_another_clocks_and_full() -> None:
    """A bucket time more than AHEAD_MAX_NS (2^48 ns, 3.3 days) ahead was written on the other
    clock the programs may read (50 to 500 days apart): full. Up to it, this clock's."""
    b = Bucket.packets_per_second(1)
    now = 5 * NS
    jiffies_clock = now + (2**32 - 300 * 1000) * 10**6  # HZ 1000: 49.7 days ahead
    assert b.admit(jiffies_clock, now, 1) == (True, now + b.cost_ns(1))
    assert b.left(jiffies_clock, now) == 1.0
    assert not b.admit(now + AHEAD_MAX_NS, now, 1)[0]
    assert b.left(now + AHEAD_MAX_NS, now) == 0.0
    assert b.admit(now - 10 * NS, now, 1)[0]  # behind the clock: full, as before


def test_the_shaper_refuses_beyond_fqs_horizon() -> None:
    """The shaper's departure may not lie further ahead than fq's horizon (10 s), which at
    1 kbit/s is far inside the burst's time (524 s); an idle shaper lets a packet leave now."""
    b = Bucket.bytes_per_second(1_000)
    now = 5 * NS
    assert b.tolerance > 50 * NS
    assert b.admit(now + 20 * NS, now, 100)[0]  # the policer's arithmetic would admit it
    assert b.admit_shaped(now + 20 * NS, now, 100) == (False, now + 20 * NS)
    assert b.admit_shaped(now + 9 * NS, now, 100) == (True, now + 9 * NS + b.cost_ns(100))
    assert b.admit_shaped(0, now, 70_000) == (True, now + b.cost_ns(70_000))
    assert b.left(now + 5 * NS, now, FQ_HORIZON_NS) == 0.5


def test_default_bursts() -> None:
    assert default_burst_bytes(1_000_000_000) == 31_250_000  # 250 ms of 1 Gbit/s
    assert default_burst_bytes(1_000_000) == BURST_MIN_BYTES  # 31,250 bytes: the least
    b = Bucket.bytes_per_second(10**9)
    assert b.tolerance == 250_000_000 and b.unit == 8 << UNIT_SHIFT


@given(
    bits=st.integers(1_000, 10**12),
    burst=st.integers(1, 10**6),
    arrivals=st.lists(
        st.tuples(st.integers(0, 10**7), st.integers(1, 9_000)), min_size=1, max_size=200
    ),
)
def test_no_more_than_the_burst_and_the_rate_pass(
    bits: int, burst: int, arrivals: list[tuple[int, int]]
) -> None:
    """Whatever arrives, what passes between the first arrival and the last costs at most their
    distance plus the burst's time (GCRA's invariant), or plus one packet's where a full bucket
    passed one that costs more (its debt), and each byte's charge is its time at the rate less
    under 1 ns per packet (rounded down)."""
    b = Bucket.bytes_per_second(bits, burst_bytes=burst)
    tat, now, charged, dearest = 0, 5 * NS, 0, 0
    first = now
    for gap, size in arrivals:
        now += gap
        ok, tat = b.admit(tat, now, size)
        if ok:
            charged += b.cost_ns(size)
            dearest = max(dearest, b.cost_ns(size))
            exact = size * 8 * NS / bits
            assert exact - 1 - size / 2**UNIT_SHIFT <= b.cost_ns(size) <= exact
    assert charged <= now - first + max(b.tolerance, dearest)


@given(
    bits=st.integers(1_000, 10**11),
    sizes=st.lists(st.integers(64, 9_000), min_size=1, max_size=300),
)
def test_traffic_that_keeps_to_the_rate_is_never_dropped(bits: int, sizes: list[int]) -> None:
    """Each packet sent no sooner than its time at the rate after the one before (rounded up
    to the nanosecond) passes, from a bucket of the least depth that takes the largest."""
    b = Bucket.bytes_per_second(bits, burst_bytes=max(sizes))
    tat, now = 0, 7 * NS
    for size in sizes:
        ok, tat = b.admit(tat, now, size)
        assert ok, (bits, size, now, tat)
        now += -(-size * 8 * NS // bits)  # its time at the rate, rounded up


def test_packet_buckets() -> None:
    b = Bucket.packets_per_second(1_000, burst_packets=5)  # one a millisecond
    tat, now = 0, NS
    for _ in range(5):
        ok, tat = b.admit(tat, now, 1)
        assert ok
    assert not b.admit(tat, now, 1)[0]
    assert b.admit(tat, now + 1_000_000, 1)[0]


def test_a_services_limits_are_read_and_a_bad_one_is_left_out() -> None:
    """A bad value costs that limit only (the others stand), and what is said names the
    annotation, the value and the fix. (The Service's reading takes these as its Problems once
    the datapath enforces the limits: issue 38.)"""
    limits, bad = read_limits({ANN_INGRESS_BANDWIDTH: "100M", ANN_INGRESS_PACKET_RATE: "100k"})
    assert limits == Limits(ingress_bps=100_000_000, ingress_pps=100_000) and bad == []
    limits, bad = read_limits(
        {ANN_INGRESS_BANDWIDTH: "100 Mbit", ANN_EGRESS_BANDWIDTH: "1G", ANN_INGRESS_PACKET_RATE: 5}
    )
    assert limits == Limits(egress_bps=10**9)
    assert bad == [
        f'annotation {ANN_INGRESS_BANDWIDTH}: "100 Mbit" is not a bit (write a number with an '
        'optional suffix k, M, G, T, P, Ki, Mi, Gi, ..., for example "100M"); the Service has '
        "no such limit until it is fixed",
        f"annotation {ANN_INGRESS_PACKET_RATE} is 5, not a string: the Service has no such "
        'limit; quote it ("100k")',
    ]
    assert read_limits({}) == (NO_LIMITS, [])
    assert not NO_LIMITS and Limits(ingress_pps=1)


@pytest.mark.parametrize(
    "limits",
    [
        Limits(ingress_bps=100_000_000),
        Limits(egress_bps=10**9),
        Limits(ingress_pps=50_000, guard=True),
        Limits(10**15, 1_000, 10**9),
    ],
)
def test_a_limits_value_reads_back_as_written(limits: Limits) -> None:
    v = limit_val(limits)
    assert limits_of(v) == limits
    # a kind without a limit has unit 0: the programs skip it
    assert (v.in_bytes.unit != 0) == (limits.ingress_bps is not None)
    assert (v.in_pkts.unit != 0) == (limits.ingress_pps is not None)
    assert (v.out_bytes.unit != 0) == (limits.egress_bps is not None)


# -- the model: annotations -> the state's limits -----------------------------------------


def _state(svc: Svc, guard: int | None = None) -> ModelResult:
    return build_state(objects(svc), guard_pps=guard)


def test_a_services_limits_reach_its_entries_and_the_state() -> None:
    svc = Svc(
        "vm",
        "203.0.113.10",
        "10.244.1.10",
        whole_ip="true",
        annotations={ANN_INGRESS_BANDWIDTH: "100M", ANN_EGRESS_BANDWIDTH: "1G"},
    )
    r = _state(svc, guard=50_000)
    assert r.state.limits == {"default/vm": Limits(100_000_000, 10**9, 50_000, guard=True)}
    (entry,) = r.state.services.values()
    (pod,) = r.state.pods.values()
    assert entry.limited and pod.limited
    assert r.problems == []
    (view,) = r.services
    assert view.limits == Limits(100_000_000, 10**9, 50_000, guard=True)


def test_a_services_own_rate_wins_over_the_guard_higher_or_lower() -> None:
    for own in ("10", "5M"):
        svc = Svc("vm", "203.0.113.10", "10.244.1.10", annotations={ANN_INGRESS_PACKET_RATE: own})
        lim = _state(svc, guard=1000).state.limits["default/vm"]
        assert lim.ingress_pps == parse_quantity(own) and not lim.guard


def test_without_limits_and_guard_nothing_is_limited() -> None:
    r = _state(Svc("vm", "203.0.113.10", "10.244.1.10"))
    assert r.state.limits == {}
    assert not any(e.limited for e in r.state.services.values())
    assert not any(e.limited for e in r.state.pods.values())


def test_only_the_guard_limits_ingress_only() -> None:
    r = _state(Svc("vm", "203.0.113.10", "10.244.1.10"), guard=1000)
    assert r.state.limits == {"default/vm": Limits(ingress_pps=1000, guard=True)}
    assert all(e.limited for e in r.state.services.values())
    assert not any(e.limited for e in r.state.pods.values())  # no egress limit


def test_a_bad_limit_is_a_warning_and_leaves_the_others() -> None:
    svc = Svc(
        "vm",
        "203.0.113.10",
        "10.244.1.10",
        annotations={ANN_INGRESS_BANDWIDTH: "fast", ANN_EGRESS_BANDWIDTH: "2G"},
    )
    r = _state(svc)
    assert r.state.limits == {"default/vm": Limits(egress_bps=2 * 10**9)}
    assert len(r.state.services) == 1  # programmed
    (p,) = r.problems
    assert p.severity == "warning" and str(p.ref) == "Service default/vm"
    assert f'annotation {ANN_INGRESS_BANDWIDTH}: "fast" is not a bit' in p.message
    assert "until it is fixed" in p.message


def test_a_service_without_a_ready_endpoint_has_no_limits_in_the_state() -> None:
    r = _state(Svc("vm", "203.0.113.10", None, annotations={ANN_EGRESS_BANDWIDTH: "1G"}))
    assert r.state.limits == {}


@pytest.mark.parametrize(
    ("value", "pps"), [("1M", 1_000_000), ("500k", 500_000), ("0", None), ("", None)]
)
def test_the_guard_flag(value: str, pps: int | None) -> None:
    cfg = SimpleNamespace(guard_packet_rate=value)
    assert RunConfig.guard_pps(cfg) == pps  # type: ignore[arg-type]


def test_a_bad_guard_names_the_flag_and_the_fix() -> None:
    cfg = SimpleNamespace(guard_packet_rate="fast")
    with pytest.raises(PermanentError) as e:
        RunConfig.guard_pps(cfg)  # type: ignore[arg-type]
    msg = str(e.value)
    assert msg.startswith('--guard-packet-rate: "fast" is not a packet'), msg
    assert "or 0 for no guard (the chart's agent.guardPacketRate)" in msg


# -- the node's ceiling of a Service's own packet rate (issue 45) -------------------------


def _ceiling(guard: str, ceiling: str) -> int | None:
    cfg = SimpleNamespace(guard_packet_rate=guard, max_packet_rate=ceiling)
    cfg.guard_pps = lambda: RunConfig.guard_pps(cfg)  # type: ignore[arg-type]
    return RunConfig.max_pps(cfg)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("guard", "ceiling", "pps"),
    [
        ("1M", "", 1_000_000),  # by default, the guard's rate
        ("1M", "5M", 5_000_000),
        ("1M", "0", None),  # none
        ("0", "", None),  # no guard, no ceiling by default
        ("0", "2M", 2_000_000),
        ("500k", "500k", 500_000),
    ],
)
def test_the_ceiling_flag(guard: str, ceiling: str, pps: int | None) -> None:
    assert _ceiling(guard, ceiling) == pps


def test_a_guard_above_the_ceiling_is_refused_at_start() -> None:
    with pytest.raises(PermanentError) as e:
        _ceiling("2M", "1M")
    msg = str(e.value)
    assert msg.startswith("--guard-packet-rate 2,000,000 is above --max-packet-rate 1,000,000"), msg
    assert "agent.guardPacketRate and agent.maxPacketRate" in msg
    with pytest.raises(PermanentError) as e:
        _ceiling("1M", "fast")
    assert str(e.value).startswith('--max-packet-rate: "fast" is not a packet'), str(e.value)


def test_a_services_rate_above_the_ceiling_is_the_ceiling_and_a_warning() -> None:
    """Whoever may annotate a Service cannot take the node's guard off: a rate above the
    ceiling (the guard's rate by default) is enforced as the ceiling, and a Warning names the
    Service, the annotation and the ceiling; a rate at or below it stands, without a word."""
    svc = Svc("vm", "203.0.113.10", "10.244.1.10", annotations={ANN_INGRESS_PACKET_RATE: "1G"})
    r = build_state(objects(svc), guard_pps=1_000_000, max_pps=1_000_000)
    assert r.state.limits["default/vm"] == Limits(ingress_pps=1_000_000)
    (p,) = r.problems
    assert str(p.ref) == "Service default/vm"  # the Event goes on the Service
    assert p.severity == "warning"
    assert p.message == (
        f"annotation {ANN_INGRESS_PACKET_RATE} asks for 1,000,000,000 packets per second, above "
        "the node's ceiling of 1,000,000 (--max-packet-rate, the chart's agent.maxPacketRate): "
        "its LB IPs get the ceiling; lower the annotation, or ask the node's operator to raise "
        "the ceiling"
    )
    for own in ("1M", "50k"):
        svc = Svc("vm", "203.0.113.10", "10.244.1.10", annotations={ANN_INGRESS_PACKET_RATE: own})
        r = build_state(objects(svc), guard_pps=1_000_000, max_pps=1_000_000)
        assert r.state.limits["default/vm"] == Limits(ingress_pps=parse_quantity(own))
        assert r.problems == []
    # without a ceiling, a Service's own rate stands, whatever it is
    svc = Svc("vm", "203.0.113.10", "10.244.1.10", annotations={ANN_INGRESS_PACKET_RATE: "1G"})
    r = build_state(objects(svc), guard_pps=1_000_000)
    assert r.state.limits["default/vm"] == Limits(ingress_pps=10**9) and r.problems == []
