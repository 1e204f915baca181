"""Differential tests: the loaded BPF programs against the reference model
(tests/support/refmodel.py).

Each hypothesis example is one map state and a batch of frames (valid, edge-case and
malformed). The maps are cleared and seeded from the state, then every frame runs through the
programs with BPF_PROG_RUN (ingress frames through both the XDP and the tc ingress program,
egress frames through the tc egress program, each as if it entered the node by a device: none,
the one the pod's addr value caches, or one the FIB does not know; the egress program in a
namespace whose routes are the model's, where the node's own packets to LB IPs are decided
as ingress, to_lb4) and the verdict, the output
bytes and the counter increments (node-wide and the frame's Service's) must equal the model's,
and so must the times of the Services' buckets (limits, issue 38), with the clock each program
read (diffharness.py says how), and, where egress is shaped (the uplinks' fq), the departure
time the egress program gives a frame (skb->tstamp) and the Services' shapers. The model's
flow and fragment records are applied as the frames go; at the end of the batch the kernel's
flow and fragment tables, and the devices the pods' addr values cache, must equal the model's.

The generator (map states and frames, `FEATURES`, CZ_DIFF_EXAMPLES and CZ_DIFF_FEATURES) is
tests/support/diffgen.py; loading, seeding, running and comparing, with scapy and a hexdump when
something differs, tests/support/diffharness.py; the hand-written cases are a table in
tests/fixtures/differential.py.
"""

from __future__ import annotations

import ctypes
import socket
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from scapy.layers.inet import TCP, UDP

from cozyebpf.datapath import bpfsys, layout, loader
from cozyebpf.datapath.buckets import FQ_HORIZON_NS
from cozyebpf.datapath.layout import FLOW4, FRAG4
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.state import Limits
from tests.fixtures.differential import (
    CLIENT6,
    LB6_FILT,
    POD6_FILT,
    REG_SEED,
    REGRESSIONS,
    Step,
    v4,
    v6,
)
from tests.support import refmodel as rm
from tests.support.diffgen import (
    DIFF_TIMEOUTS,
    EXAMPLES,
    FEATURES,
    SPOOF_DEVS,
    TO_LB,
    Scenario,
    address,
    build,
    scenarios,
)
from tests.support.diffharness import (
    PROGRAMS,
    Datapath,
    Skb,
    answers,
    check_buckets,
    check_devs,
    check_frame,
    check_tables,
    scapy_command,
    to_lb_netns,
)
from tests.support.packets import CLIENT, LB_FILT, LB_WHOLE, POD_FILT, POD_WHOLE, assert_frame
from tests.support.refmodel import LIMIT, PORT_FILTER, Pod, RefState, Svc, Tats


@pytest.fixture(scope="module")
def dp(request: pytest.FixtureRequest) -> Iterator[Datapath]:
    """The programs loaded once for the module; how much they ran is reported at the end."""
    from cozyebpf.datapath.attach import detach_all
    from tests.support.env import unique_prefix

    for dev in SPOOF_DEVS:  # the FIB must know none of them (spoofed unless cached)
        with pytest.raises(OSError):
            socket.if_indextoname(dev)
    pin_dir = f"/sys/fs/bpf/{unique_prefix('diff')}"
    maps = PinnedMaps.ensure(pin_dir)
    maps.set_flow_timeouts(**DIFF_TIMEOUTS)
    started = time.monotonic()
    try:
        progs = {name: loader.load(*spec, pin_dir) for name, spec in PROGRAMS.items()}
        with to_lb_netns(unique_prefix("difflb"), TO_LB) as net:
            d = Datapath(maps, progs, net)
            yield d
        capture = request.config.pluginmanager.get_plugin("capturemanager")
        if capture is not None and d.frames:
            with capture.global_and_fixture_disabled():
                print(
                    f"\ndifferential: {d.frames} frames checked against the model, {d.runs} "
                    f"program runs, in {time.monotonic() - started:.0f} s; limits: "
                    + ", ".join(f"{k} {v}" for k, v in sorted(d.met.items()))
                )
    finally:
        maps.close()
        detach_all(pin_dir)


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
    state = scenario.seed.state(now, dp.limit_now())
    dp.seed(state, now)
    for i, f in enumerate(scenario.frames):
        frame = build(f)
        skb = Skb(0, f.wire_len(len(frame)), f.gso, now + f.tstamp if f.tstamp else 0)
        result = check_frame(dp, state, frame, f.egress, f.in_dev, skb)
        state.apply(result, time.monotonic_ns())
        if result.new_flows or result.frags or result.flow_vals:
            check_tables(dp, state, f"after frame {i}: {scapy_command(frame)}")
        if result.devs:
            check_devs(dp, state, f"after frame {i}: {scapy_command(frame)}")
    check_tables(dp, state, "after the batch")
    check_devs(dp, state, "after the batch")


def test_the_harness_reads_the_counters_as_the_product_does(dp: Datapath) -> None:
    """Datapath.counters (one batch lookup) == PinnedMaps.counters, after the run above."""
    product = {r: (v["packets"], v["bytes"]) for r, v in dp.maps.counters().items()}
    assert any(packets for packets, _ in product.values())
    assert dp.counters() == product


def test_the_run_met_source_ranges_expired_flows_and_learning(dp: Datapath) -> None:
    """The generated states exercised what they are for: drops from outside a pod's ranges,
    replies of flows (some expired), and TCP let in to migrating pods."""
    if not {"ranges", "expiry", "learn"} <= FEATURES or dp.frames == 0:
        pytest.skip("ranges, expiry or learn not generated in this run")
    counts = dp.counters()
    assert counts.get("drop_source", (0, 0))[0] > 0, counts
    assert counts.get("pass_reply", (0, 0))[0] > 0, counts
    assert counts.get("pass_learn", (0, 0))[0] > 0, counts


def test_the_run_met_the_limits(dp: Datapath) -> None:
    """Buckets were charged, and refused frames in XDP, tc ingress and egress."""
    if "limits" not in FEATURES or dp.frames == 0:
        pytest.skip("limits not generated in this run")
    assert dp.met["charged"] > 0, dp.met
    for prog in PROGRAMS:
        assert dp.met[f"{prog} refused"] > 0, dp.met
    assert dp.counters().get("drop_limit", (0, 0))[0] > 0


def test_the_run_met_the_shaper_and_gso_packets(dp: Datapath) -> None:
    """Shaped egress met a busy shaper (the frame given its departure time), an idle one, one
    past its horizon (refused), and frames from LB IPs; GSO packets were charged their
    wire_len out (and GRO packets their segments into tc ingress, where generated)."""
    if not {"limits", "shaped", "gso"} <= FEATURES or dp.frames == 0:
        pytest.skip("limits, shaped or gso not generated in this run")
    met = [
        "shaped: busy",
        "shaped: idle",
        "shaped: beyond the horizon",
        "shaped: from an LB IP",
        "gso: egress charged wire_len",
    ]
    if "gso-in" in FEATURES:
        met.append("gso: tc ingress charged segments")
    for what in met:
        assert dp.met[what] > 0, (what, dp.met)


def test_the_run_met_spoofed_sources(dp: Datapath) -> None:
    """Egress frames from managed pod IPs entered by a device that is not theirs: dropped."""
    if "spoof" not in FEATURES or dp.frames == 0:
        pytest.skip("spoof not generated in this run")
    counts = dp.counters()
    assert counts.get("drop_spoofed", (0, 0))[0] > 0, counts


def test_the_run_met_the_nodes_packets_to_lb_ips(dp: Datapath) -> None:
    """The node's packets to LB IPs (to_lb4) were handed to the pods' device, answered with
    fragmentation-needed, dropped by a filter and refused by a Service's limit."""
    if not {"to-lb", "limits"} <= FEATURES or dp.frames == 0:
        pytest.skip("to-lb or limits not generated in this run")
    for what in (
        "to-lb: to the pod",
        "to-lb: frag-needed",
        "to-lb: dropped",
        "to-lb: refused by the limit",
    ):
        assert dp.met[what] > 0, (what, dp.met)


@pytest.mark.parametrize("payload", [0, 200], ids=["fits", "too-big-for-the-pod-device"])
def test_a_nodes_packet_that_the_limit_refuses_opens_no_flow(dp: Datapath, payload: int) -> None:
    """The node's packet to an LB IP whose Service's limit refuses it (issue 45): dropped and
    counted as drop_limit, no flow of the pod recorded and, too big for the pod's device, no
    fragmentation-needed (before, to_lb4 recorded the flow and answered the size: a tenant
    flooding another tenant's limited LB IP wrote flow entries at any rate). Its bucket
    refilled, the same packet goes to the pod, its flow recorded (or the size is answered)."""
    dp.clear()
    svc, limits = "diff/to-lb", Limits(ingress_pps=1)
    lb, pod = address(LB_WHOLE), address(POD_WHOLE)
    now, limit_now = time.monotonic_ns(), dp.limit_now()
    state = RefState(
        svc={lb: Svc(pod, LIMIT, svc)},
        limits={svc: limits},
        to_lb=TO_LB,
    )
    bucket = rm.limit_buckets(limits)[1]
    assert bucket is not None
    state.buckets[svc] = Tats(0, limit_now + 10 * bucket.tolerance, 0)  # refuses for long
    dp.seed(state, now)
    node = str(min(TO_LB.node_ips))
    frame = bytes(v4(LB_WHOLE, src=node) / TCP(sport=41000, dport=22, flags="S") / (b"x" * payload))
    result = check_frame(dp, state, frame, True)
    assert (result.verdict, result.counts) == (rm.DROP, {"drop_limit": (1, len(frame))})
    assert dp.flows() == {}
    state.apply(result, now)
    state.buckets[svc] = Tats()  # refilled
    dp.set_buckets(svc, Tats())
    result = check_frame(dp, state, frame, True)
    assert result.verdict == rm.REDIRECT
    if payload:  # fragmentation-needed to the node: nothing counted or recorded
        assert result.counts == {} and dp.flows() == {}
    else:
        assert result.counts == {"nat_ingress": (1, len(frame)), "flow_new": (1, 0)}
        assert dp.flows() == {rm.FlowKey(pod, address(node), 22, 41000, rm.TCP): False}


@pytest.mark.parametrize("steps", REGRESSIONS)
def test_regression(dp: Datapath, steps: tuple[Step, ...]) -> None:
    """The cases the spec names: the model gives the hand-written answer, and so do the
    programs (the XDP and tc ingress programs, or the egress program)."""
    dp.clear()
    now = time.monotonic_ns()
    state = REG_SEED.state(now, dp.limit_now())
    dp.seed(state, now)
    for step in steps:
        frame = bytes(step.frame)
        if step.egress:
            model = rm.egress(state, frame, now, step.in_dev, dp.limit_now())
        else:
            model = rm.ingress(state, frame, now, dp.limit_now())
        want = {r: (1, 0 if r == "flow_new" else len(frame)) for r in step.reasons}
        assert (model.verdict, model.counts) == (step.verdict, want), "the model"
        expected = step.out if step.out is not None else frame
        assert_frame(model.frame, expected, "the model's output")
        state.apply(check_frame(dp, state, frame, step.egress, step.in_dev), now)
    check_tables(dp, state, "after the steps")
    check_devs(dp, state, "after the steps")


# -- the clock ------------------------------------------------------------------------------


def test_a_window_across_a_buckets_boundary_gives_both_verdicts() -> None:
    """The harness's reading of a run's clock window: when the bucket starts admitting inside
    [lo, hi], the model gives two stretches (refused up to the boundary, admitted from it), and
    a bucket time is held to the stretch of the verdict the program gave."""
    svc = "diff/window"
    bucket = rm.limit_buckets(Limits(ingress_pps=1))[1]
    assert bucket is not None
    state = RefState(
        svc={address(LB_WHOLE): Svc(address(POD_WHOLE), LIMIT, svc)},
        limits={svc: Limits(ingress_pps=1)},
    )
    tat = 500 * 10**9
    state.buckets[svc] = Tats(0, tat, 0)
    boundary = tat + bucket.cost_ns(1) - bucket.tolerance  # the first `now` that admits
    frame = bytes(v4(LB_WHOLE) / UDP(sport=1, dport=2))

    def model(now: int) -> rm.Result:
        return rm.ingress(state, frame, now)

    lo, hi = boundary - 7, boundary + 5
    refused, admitted = answers(model, lo, hi, model(lo))
    assert (refused.start, refused.end) == (lo, boundary - 1)
    assert (admitted.start, admitted.end) == (boundary, hi)
    assert refused.first.counts.keys() == refused.last.counts.keys() == {"drop_limit"}
    assert admitted.first.counts.keys() == {"nat_ingress"}
    before = {svc: state.buckets[svc]}
    moved = Tats(0, tat + bucket.cost_ns(1), 0)
    assert check_buckets({svc: before[svc]}, before, refused) == {}
    assert check_buckets({svc: moved}, before, admitted) == {}
    assert check_buckets({svc: moved}, before, refused)  # charged, yet refused
    assert check_buckets({svc: before[svc]}, before, admitted)  # admitted, not charged
    # an idle bucket starts at the program's clock: any time the window allows
    state.buckets[svc] = Tats()
    (idle,) = answers(model, lo, hi, model(lo))
    for now in (lo, hi):
        assert check_buckets({svc: Tats(0, now + bucket.cost_ns(1), 0)}, {svc: Tats()}, idle) == {}
    assert check_buckets({svc: Tats(0, hi + bucket.cost_ns(1) + 1, 0)}, {svc: Tats()}, idle)


def test_a_shapers_window_gives_each_decision_in_turn() -> None:
    """Shaped egress over a window that holds both of the shaper's boundaries: refused beyond
    the horizon, then the busy shaper's departure time as skb->tstamp, then (from out_edt on)
    the frame's own tstamp; the shaper's time held to each stretch."""
    svc = "diff/shaper"
    limits = Limits(egress_bps=1_000)
    bucket = rm.limit_buckets(limits)[2]
    assert bucket is not None
    pod, lb = address(POD_WHOLE), address(LB_WHOLE)
    state = RefState(pod={pod: Pod(lb, LIMIT, svc)}, limits={svc: limits}, shaped=True)
    edt, mine = 900 * 10**9, 12345
    state.buckets[svc] = Tats(out_edt=edt)
    frame = bytes(v4(CLIENT, src=POD_WHOLE) / UDP(sport=1, dport=2))
    cost = bucket.cost_ns(len(frame))
    # the first `now` inside the horizon: fq's (10 s), at 1 kbit/s far shorter than the
    # burst's time (524 s)
    assert edt + cost - bucket.tolerance < edt - FQ_HORIZON_NS
    admits = edt - FQ_HORIZON_NS

    def model(now: int) -> rm.Result:
        return rm.egress(state, frame, 0, mono_ns=now, tstamp=mine)

    lo, hi = admits - 3, edt + 4
    refused, busy, idle = answers(model, lo, hi, model(lo))
    assert (refused.start, refused.end) == (lo, admits - 1)
    assert refused.first.counts.keys() == {"drop_limit"} and refused.first.tstamp == mine
    assert (busy.start, busy.end, busy.first.tstamp) == (admits, edt - 1, edt)
    assert (idle.start, idle.end, idle.first.tstamp) == (edt, hi, mine)
    before = {svc: state.buckets[svc]}
    assert check_buckets({svc: Tats(out_edt=edt + cost)}, before, busy) == {}
    assert check_buckets({svc: Tats(out_edt=hi + cost)}, before, idle) == {}
    assert check_buckets({svc: Tats(out_edt=edt + cost)}, before, refused)  # moved, refused
    assert check_buckets({svc: Tats(out_bytes=1, out_edt=edt + cost)}, before, busy)  # policer


def test_timestamps_are_the_monotonic_clocks(dp: Datapath) -> None:
    """Fragment entries are seeded with time.monotonic_ns(): the first fragment's timestamp
    (bpf_ktime_get_ns) must be CLOCK_MONOTONIC. A flow's is bpf_ktime_get_coarse_ns (a tenth
    of the cost on the egress path, and exact enough for a refresh once a second):
    CLOCK_MONOTONIC_COARSE."""
    dp.clear()
    pod, lb = address(POD_FILT), address(LB_FILT)
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
    pod, lb = address(POD6_FILT), address(LB6_FILT)
    dp.seed(RefState(pod={pod: Pod(lb, PORT_FILTER)}), 0)
    fd, lay = dp.maps.fds["flowhint"], dp.maps.layout
    for words in range(2 * lay.hint_words):  # start from an empty hint
        bpfsys.map_update(fd, ctypes.c_uint32(words), ctypes.c_uint64(0))
    dp.run("egress", bytes(v6(CLIENT6, src=POD6_FILT) / UDP(sport=40001, dport=53)))
    bit = layout.flow_hint_bit(
        pod.packed, address(CLIENT6).packed, 40001, 53, rm.UDP, lay.hint_log2
    )
    got = ctypes.c_uint64()
    assert bpfsys.map_lookup(fd, ctypes.c_uint32(2 * (bit >> 6)), got)  # the programs' word
    assert got.value == 1 << (bit & 63)
