"""The agent loop against a fake datapath: a change is written without reading the maps and
touches only its own entries; changes that arrive together are written together; a failed
write is repaired by a full resync after a delay (never a tight retry loop); the periodic
resync repairs drift; nothing is written before the source was read completely."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from cozyebpf.agent import Agent
from cozyebpf.errors import DatapathError
from cozyebpf.model import build_state, read_object, read_objects
from cozyebpf.sources import ChangeSet
from cozyebpf.state import MapState
from cozylab.fakedp import FakeDatapath
from cozylab.k8s import Svc, objects
from tests.support.clock import FakeClock
from tests.support.sources import IdleSource

Obj = dict[str, Any]


class ApiLikeSource(IdleSource):
    """Hands over changes object by object, as the Kubernetes source does."""

    def __init__(self, objs: list[Obj]) -> None:
        self.objects: dict[tuple[str, str, str], Obj] = {}
        self.pending = ChangeSet()
        self.ready = False
        for o in objs:
            self.put(o)

    def _key(self, o: Obj) -> tuple[str, str, str]:
        return (o["kind"], o["metadata"]["namespace"], o["metadata"]["name"])

    def put(self, o: Obj) -> None:
        self.objects[self._key(o)] = o
        self._record(o, read_object(o, 0))

    def delete(self, o: Obj) -> None:
        self.objects.pop(self._key(o), None)
        self._record(o, None)

    def _record(self, o: Obj, rec: Any) -> None:
        key = (o["metadata"]["namespace"], o["metadata"]["name"])
        if o["kind"] == "Service":
            self.pending.services[key] = rec
        else:
            self.pending.slices[key] = (rec,) if rec is not None else None

    def take(self) -> ChangeSet | None:
        if not self.ready:
            return None
        out, self.pending = self.pending, ChangeSet()
        return out

    def full_model(self) -> MapState:
        return build_state(list(self.objects.values())).state


VMS = [Svc(f"vm{i}", f"203.0.113.{i + 1}", f"10.244.1.{i + 1}", [("TCP", 22)]) for i in range(20)]


def cluster() -> list[Obj]:
    return [o for s in VMS for o in objects(s)]


def moved(i: int, pod: str) -> Obj:
    """vm<i>'s EndpointSlice, its endpoint at `pod`."""
    s = VMS[i]
    return objects(Svc(s.name, s.lb_ip, pod, s.ports))[1]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def setup(clock: FakeClock) -> tuple[Agent, ApiLikeSource, FakeDatapath]:
    src, dp = ApiLikeSource(cluster()), FakeDatapath()
    return Agent(src, dp, resync_interval=3600, retry_delay=0.1, clock=clock), src, dp


def test_nothing_is_written_before_the_source_is_complete(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath],
) -> None:
    agent, src, dp = setup
    agent.tick()
    assert dp.applies == [] and dp.reads == 0 and not agent.synced_once
    src.ready = True
    agent.tick()
    assert dp.state == src.full_model() and agent.synced_once
    assert dp.reads == 1  # the full sync at start reads the maps once


def test_a_change_writes_only_its_own_entries_without_reading(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath],
) -> None:
    agent, src, dp = setup
    src.ready = True
    agent.tick()
    reads = dp.reads
    src.put(moved(7, "10.244.2.7"))
    agent.tick()
    assert dp.reads == reads, "a change is written without reading the maps"
    d = dp.applies[-1]
    assert [str(k) for k in d.services_set] == ["203.0.113.8"]
    assert [str(k) for k in d.pods_set] == ["10.244.2.7"]
    assert [str(k) for k in d.pods_del] == ["10.244.1.8"]
    assert {str(a.pod_ip) for a in d.allowed_add | d.allowed_del} == {"10.244.1.8", "10.244.2.7"}
    assert dp.state == src.full_model()
    agent.tick()  # nothing new: nothing written
    assert len(dp.applies) == 2


def test_changes_that_arrive_together_are_written_together(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath],
) -> None:
    agent, src, dp = setup
    src.ready = True
    agent.tick()
    for i in range(10):
        src.put(moved(i, f"10.244.3.{i}"))
    src.put(moved(3, "10.244.4.3"))  # the same object twice: the newest counts
    src.delete(objects(VMS[15])[0])
    agent.tick()
    assert len(dp.applies) == 2
    assert dp.state == src.full_model()


def test_a_failed_write_is_repaired_by_a_full_resync_after_a_delay(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath],
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    agent, src, dp = setup
    src.ready = True
    agent.tick()
    dp.fail_next_apply = DatapathError("programming maps failed: No space left (map full?)")
    src.put(moved(1, "10.244.5.1"))
    with caplog.at_level(logging.ERROR, "cozyebpf.agent"):
        agent.tick()
        src.put(moved(2, "10.244.5.2"))  # arrives while the maps are out of sync
        for _ in range(5):
            clock.advance(0.01)
            agent.tick()  # no tight loop: nothing is tried before the delay (0.1 s)
    assert len(dp.applies) == 2 and dp.state != src.full_model()
    assert caplog.text.count("map full?") == 1
    reads = dp.reads
    clock.advance(0.06)  # past the delay
    agent.tick()
    assert dp.reads == reads + 1, "the repair reads the maps"
    assert dp.state == src.full_model()
    # and changes are written one by one again
    src.put(moved(3, "10.244.5.3"))
    agent.tick()
    assert dp.reads == reads + 1 and dp.state == src.full_model()


def test_retries_back_off(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath], clock: FakeClock
) -> None:
    agent, src, dp = setup
    src.ready = True
    delays = []
    for _ in range(4):
        dp.fail_next_apply = DatapathError("boom")
        agent.tick()
        delays.append(agent.next_timer())
        clock.advance(agent.next_timer() + 0.001)  # the retry falls due
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8])
    agent.tick()  # the fifth try writes
    assert agent.synced_once and dp.state == src.full_model()


def test_the_periodic_resync_repairs_drift(clock: FakeClock) -> None:
    src, dp = ApiLikeSource(cluster()), FakeDatapath()
    src.ready = True
    agent = Agent(src, dp, resync_interval=3600, clock=clock)
    agent.tick()
    lb = next(iter(dp.state.services))
    del dp.state.services[lb]  # someone deleted an entry
    clock.advance(3599)
    agent.tick()
    assert lb not in dp.state.services, "not before the resync is due"
    clock.advance(1)  # the resync falls due
    agent.tick()
    assert dp.state == src.full_model()


def test_problems_are_reported_once_as_they_appear(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath], caplog: pytest.LogCaptureFixture
) -> None:
    agent, src, _ = setup
    seen: list[str] = []
    agent.on_problems = lambda ps: seen.extend(str(p) for p in ps)
    src.ready = True
    twin = objects(Svc("twin", VMS[0].lb_ip, "10.244.9.9", created="2027-01-01T00:00:00Z"))
    for o in twin:
        src.put(o)
    with caplog.at_level(logging.WARNING, "cozyebpf.agent"):
        agent.tick()
        agent.tick()
        src.put(moved(5, "10.244.6.5"))
        agent.tick()
    assert seen == [
        "Service default/twin: LoadBalancer IP 203.0.113.1 is also claimed by the older "
        "Service default/vm0, which keeps it; give each Service its own LoadBalancer IP"
    ]
    assert caplog.text.count("also claimed") == 1
    src.delete(twin[0])
    agent.tick()
    for o in twin:
        src.put(o)
    agent.tick()  # gone and back: reported again
    assert len(seen) == 2


def test_whole_sets_from_a_manifest_change_only_what_differs() -> None:
    """A manifest source hands over the whole file each time; the model writes the delta."""

    class WholeSource(ApiLikeSource):
        def take(self) -> ChangeSet | None:
            return ChangeSet(whole=read_objects(list(self.objects.values())))

    src, dp = WholeSource(cluster()), FakeDatapath()
    agent = Agent(src, dp, resync_interval=3600)
    agent.tick()
    src.put(moved(4, "10.244.7.4"))
    agent.tick()
    assert [str(k) for k in dp.applies[-1].services_set] == ["203.0.113.5"]
    assert dp.state == src.full_model()


def test_each_write_is_reported_with_the_programming_latency_of_its_changes(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath],
) -> None:
    """Observers (the metrics) get one report per write: its kind, and for every change it
    covered the time from when the change was made (the EndpointSlice controller's trigger
    time when there is one) to the end of the write."""
    agent, src, _ = setup
    reports = []
    agent.on_sync.append(reports.append)
    src.ready = True
    agent.tick()
    assert [(r.kind, r.ok) for r in reports] == [("full", True)]
    src.put(moved(2, "10.244.8.2"))
    # the change was made two seconds ago
    src.pending.touch(("EndpointSlice", ("default", "vm2")), time.time() - 2.0)
    agent.tick()
    (r,) = reports[1:]
    assert r.kind == "change" and r.ok and len(r.latencies) == 1
    assert 2.0 <= r.latencies[0] < 10
    assert agent.stats.syncs == 2 and agent.stats.full_syncs == 1
    assert agent.stats.last_sync is not None and agent.stats.sync_errors == 0


@pytest.fixture
def unfrozen() -> Any:
    """The collector as a test finds it, and as it leaves it (the agent freezes the heap)."""
    import gc

    gc.unfreeze()
    yield gc
    gc.unfreeze()


def test_a_large_batch_is_frozen_out_of_the_collectors_passes(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath], unfrozen: Any
) -> None:
    """After the first sync and after a whole set the agent freezes the heap (gc.freeze): a
    full collection over 70,000 Services' caches took 1.4-1.6 s, and a SIGTERM that landed
    during one waited for it. A small change freezes nothing."""
    gc = unfrozen
    agent, src, dp = setup
    src.ready = True
    agent.tick()  # the first sync
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
    src.put(moved(5, "10.244.5.5"))
    agent.tick()
    assert gc.get_freeze_count() == 0, "a small change froze the heap"
    src.pending = ChangeSet(whole=read_objects(list(src.objects.values())))
    agent.tick()
    assert gc.get_freeze_count() > 0
    assert dp.state == src.full_model()


class _Node:
    """An object that can hold a reference to another: two of them make a cycle."""

    other: object = None


def test_a_cycle_dropped_before_the_freeze_is_freed(
    setup: tuple[Agent, ApiLikeSource, FakeDatapath], unfrozen: Any
) -> None:
    """Garbage cycles left by a large batch (which runs with the collector paused) are collected
    before the heap is frozen, not frozen with it for good (issue 28): after the freeze, the
    cycle is gone, and no collection later could have freed it."""
    import weakref

    gc = unfrozen
    agent, src, _ = setup
    src.ready = True
    was = gc.isenabled()
    gc.disable()  # as during a large batch (gc_paused): only the freeze's own work may free it
    try:
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b  # garbage now, but a cycle: reference counting cannot free it
        assert gone() is not None
        src.pending = ChangeSet(whole=read_objects(list(src.objects.values())))
        agent.tick()  # a large batch (the first sync): the agent freezes the heap
        assert gc.get_freeze_count() > 0
        assert gone() is None, "a dropped cycle was frozen with the heap"
    finally:
        if was:
            gc.enable()


def test_own_limits_without_a_counter_slot_are_a_problem_until_it_has_one(
    clock: FakeClock,
) -> None:
    """Every counter slot taken (the fake counts the first `counted` Services by name): the
    Service with limits of its own beyond them is reported once, naming its limits and the fix;
    one with the node's guard alone is not (the log line of the slots says that); once every
    Service has a slot, the Problem is resolved."""
    limited = Svc("vm9", VMS[9].lb_ip, VMS[9].pod_ip, VMS[9].ports,
                  annotations={"networking.cozystack.io/egressBandwidth": "100M"})  # fmt: skip
    objs = [o for s in [*VMS[:9], limited, *VMS[10:]] for o in objects(s)]
    src, dp = ApiLikeSource(objs), FakeDatapath()
    dp.counted = 18  # vm8 and vm9 (by name, after vm19) get none
    agent = Agent(src, dp, resync_interval=3600, clock=clock, guard_pps=10**6)
    seen: list[str] = []
    agent.on_problems = lambda ps: seen.extend(str(p) for p in ps)
    src.ready = True
    agent.tick()
    agent.tick()
    want = (
        "Service default/vm9: has limits of its own (ingress 1 Mpackets/s (the node's guard); "
        "egress 100 Mbit/s) that are not enforced: a Service's limits live in its per-Service "
        "counter slot, and all 18 of this node's are taken; raise --counted-services (the "
        "chart's agent.countedServices) above the number of Services"
    )
    assert seen == [want]
    assert [str(p) for p in agent.problems()] == [want]
    dp.counted = None
    src.put(moved(3, "10.244.6.3"))  # any write asks again
    agent.tick()
    assert agent.problems() == [] and seen == [want]
