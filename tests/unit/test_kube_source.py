"""The Kubernetes source (informers on the official client) and the Event recorder, against
the API server double in cozylab/kubeapi/: list then watch from the list's resourceVersion,
resume after a dropped watch, relist on 410, keep the last state through an outage."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cozyebpf.agent import Agent
from cozyebpf.dump import build_dump
from cozyebpf.kube.events import EventRecorder, event_name
from cozyebpf.model import ObjectRef, Problem
from cozyebpf.sources.kube import Backoff, KubeSource
from cozylab.fakedp import FakeDatapath
from cozylab.k8s import Svc, objects
from cozylab.kubeapi import FakeKubeAPI
from tests.support.clock import FakeClock
from tests.support.labtools import wait_for

VM1 = Svc("vm1", "203.0.113.10", "10.244.1.10", [("TCP", 22)], whole_ip="true")
VM2 = Svc("vm2", "203.0.113.20", "10.244.1.20", [("TCP", 80)])
OTHER = Svc("not-ours", "203.0.113.30", "10.244.1.30", proxy_name="kube-proxy")


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_interval=0.2) as a:
        yield a


@pytest.fixture
def source(api: FakeKubeAPI) -> Iterator[KubeSource]:
    src = KubeSource(api.api_client(), "cozy-proxy", watch_timeout=5, request_timeout=5)
    for inf in src.informers:
        inf.backoff = Backoff(base=0.05, cap=0.2)
    yield src
    src.stop()


def put(api: FakeKubeAPI, *svcs: Svc) -> None:
    for s in svcs:
        for o in objects(s):
            api.apply(o)


class Taken:
    """What the source handed over so far: the objects the agent's model would hold."""

    def __init__(self, src: KubeSource) -> None:
        self.src = src
        self.services: dict[tuple[str, str], Any] = {}
        self.slices: dict[tuple[str, str], Any] = {}
        self.foreign: dict[tuple[str, str], Any] = {}

    def take(self) -> bool:
        """Take the source's changes; True when there were any."""
        cs = self.src.take()
        if cs is None:
            return False
        for mine, theirs in (
            (self.services, cs.services),
            (self.slices, cs.slices),
            (self.foreign, cs.foreign),
        ):
            for key, rec in theirs.items():
                if rec is None:
                    mine.pop(key, None)
                else:
                    mine[key] = rec
        return len(cs) > 0

    def names(self) -> set[str]:
        return {f"Service/{name}" for _, name in self.services}

    def until(self, names: set[str]) -> bool:
        """Take what there is; whether the Services are now `names`."""
        self.take()
        return self.names() == names


@pytest.fixture
def taken(source: KubeSource) -> Taken:
    return Taken(source)


def watches(api: FakeKubeAPI, path_part: str) -> list[dict[str, str]]:
    return [r.query for r in api.requests if path_part in r.path and r.query.get("watch")]


def lists(api: FakeKubeAPI, path_part: str) -> list[dict[str, str]]:
    return [r.query for r in api.requests if path_part in r.path and not r.query.get("watch")]


def test_nothing_is_reported_before_every_resource_is_listed(
    api: FakeKubeAPI, source: KubeSource, taken: Taken
) -> None:
    put(api, VM1)
    api.fail_next(3, 503, paths="endpointslices")
    source.start()
    wait_for(lambda: source.informers[0].synced, 5, "services listed")
    wait_for(lambda: source.informers[2].synced, 5, "nodes listed")
    assert source.take() is None
    assert [i.synced for i in source.informers] == [True, False, True]
    wait_for(taken.take, 5, "both listed after the 503s")
    # list items carry no kind: it is put back, so they are read as what they are
    assert list(taken.services) == [("default", "vm1")]
    assert [r.ref.kind for (r,) in taken.slices.values()] == ["EndpointSlice"]


def test_selects_by_label_and_watches_from_the_list_resource_version(
    api: FakeKubeAPI, source: KubeSource, taken: Taken
) -> None:
    put(api, VM1, OTHER)
    rv_at_list = api.resource_version()
    source.start()
    wait_for(taken.take, 5, "the first list")
    assert taken.names() == {"Service/vm1"}
    # all Services are listed: of the others only their LB IPs are kept
    assert "labelSelector" not in lists(api, "/services")[0]
    assert [str(ip) for r in taken.foreign.values() for ip in r.lb_ips] == ["203.0.113.30"]
    first_watch = wait_for(lambda: watches(api, "/services"), 5, "a watch")[0]
    assert first_watch["allowWatchBookmarks"] == "true"
    assert first_watch["resourceVersion"] == str(rv_at_list)  # no gap, no replay
    put(api, VM2)
    wait_for(taken.take, 5, "the watch event")
    assert taken.names() == {"Service/vm1", "Service/vm2"}
    api.delete("Service", "default", "vm1")
    wait_for(taken.take, 5, "the delete")
    assert taken.names() == {"Service/vm2"}
    assert [inf.lists for inf in source.informers] == [1, 1, 1]  # no relist needed


def test_updates_that_change_nothing_the_model_reads_are_dropped(
    api: FakeKubeAPI, source: KubeSource, taken: Taken
) -> None:
    put(api, VM1)
    source.start()
    wait_for(taken.take, 5, "the first list")
    svc = api.get("Service", "default", "vm1")
    assert svc is not None
    svc["metadata"].setdefault("labels", {})["team"] = "a"  # not read by the model
    rv = api.resource_version()
    api.apply(svc)
    wait_for(lambda: int(source.informers[0].resource_version or 0) > rv, 5, "the event")
    assert not taken.take()  # nothing handed over
    svc["metadata"]["annotations"] = {"networking.cozystack.io/wholeIP": "false"}
    api.apply(svc)
    wait_for(taken.take, 5, "the change of mode")
    (rec,) = taken.services.values()
    assert rec.service is not None and rec.service.port_filter


def test_a_dropped_watch_resumes_without_a_relist(
    api: FakeKubeAPI, source: KubeSource, taken: Taken
) -> None:
    put(api, VM1)
    source.start()
    wait_for(taken.take, 5, "the first list")
    wait_for(lambda: api.open_watches() == 3, 5, "three watches")
    rv_before = source.informers[0].resource_version
    assert api.drop_watches() == 3
    put(api, VM2)
    wait_for(lambda: taken.until({"Service/vm1", "Service/vm2"}), 5, "the change")
    assert taken.names() == {"Service/vm1", "Service/vm2"}
    assert [inf.lists for inf in source.informers] == [1, 1, 1]
    resumed = [int(q["resourceVersion"]) for q in watches(api, "/services")]
    assert resumed[-1] >= int(rv_before or 0) and len(resumed) >= 2


def test_410_gone_relists(api: FakeKubeAPI, source: KubeSource, taken: Taken) -> None:
    put(api, VM1)
    source.start()
    wait_for(taken.take, 5, "the first list")
    wait_for(lambda: api.open_watches() == 3, 5, "three watches")
    api.stop()  # the watches break while the history moves on and is compacted
    put(api, VM2)
    api.delete("Service", "default", "vm1")
    api.compact()
    api.start()
    wait_for(lambda: source.informers[0].lists >= 2, 10, "a relist after 410")
    wait_for(lambda: taken.until({"Service/vm2"}), 5, "the new state")
    assert taken.names() == {"Service/vm2"}


def test_outage_keeps_the_last_state_then_converges(
    api: FakeKubeAPI, source: KubeSource, taken: Taken
) -> None:
    put(api, VM1)
    source.start()
    wait_for(taken.take, 5, "the first list")
    assert taken.names() == {"Service/vm1"}
    api.set_down(True)
    wait_for(lambda: any(i.backoff.attempt for i in source.informers), 10, "a failed retry")
    assert not taken.take() and taken.names() == {"Service/vm1"}  # fail-static
    assert source.alive()
    put(api, VM2)
    api.set_down(False)
    wait_for(lambda: taken.until({"Service/vm1", "Service/vm2"}), 10, "convergence")
    assert taken.names() == {"Service/vm1", "Service/vm2"}


def test_agent_programs_only_after_a_complete_list(api: FakeKubeAPI, source: KubeSource) -> None:
    """An agent starting during an outage must not wipe the pinned state with nothing."""
    from cozyebpf.state import MapState

    dp = FakeDatapath()
    put(api, VM1)
    agent = Agent(source, dp)
    pinned: dict[str, Any] = build_dump(dp.state)
    api.set_down(True)
    source.start()
    agent.tick()
    assert build_dump(dp.state) == pinned and agent.readiness() == "not synced yet"
    api.set_down(False)
    wait_for(lambda: source.synced, 10, "the list")
    agent.tick()
    assert [s["lb_ip"] for s in build_dump(dp.state)["services"]] == ["203.0.113.10"]
    assert agent.readiness() is None
    assert isinstance(dp.state, MapState)


def _failing_agent(source: KubeSource) -> tuple[Agent, FakeDatapath, FakeClock, list[Any]]:
    """An agent on `source` (started, listed) whose every write fails (a full map), on a
    clock of the test's; the reports of its writes."""
    from cozyebpf.errors import DatapathError

    clock, dp = FakeClock(), FakeDatapath()
    dp.failing = DatapathError("programming maps failed: No space left on device (map full?)")
    agent = Agent(source, dp, resync_interval=60, retry_delay=0.1, clock=clock)
    reports: list[Any] = []
    agent.on_sync.append(reports.append)
    source.start()
    wait_for(lambda: source.synced, 10, "the list")
    return agent, dp, clock, reports


def _retry(agent: Agent, clock: FakeClock) -> None:
    """One turn of the agent with its retry due (the full resync is tried)."""
    clock.advance(61)
    agent.tick()


def test_changes_while_writes_fail_are_kept_once_per_object(
    api: FakeKubeAPI, source: KubeSource
) -> None:
    """Issue 45, item 8: while every write fails (a full map, a refused write), the agent keeps
    when each change it has not programmed was made, for the network programming latency of
    the write that succeeds. It kept one entry per API change: 600 changes of one EndpointSlice
    were 600 entries (and a day of them grew until the pod's memory limit killed the agent).
    Now it keeps the oldest change per object: two Services, their two slices, and the slice
    changed 600 times make at most four latencies, the longest the first change's (an hour
    ago, its trigger time)."""
    from datetime import UTC, datetime, timedelta

    from cozyebpf.sources.kube import TRIGGER_ANNOTATION

    put(api, VM1, VM2)
    agent, dp, clock, reports = _failing_agent(source)
    slice_ = objects(VM1)[1]
    hour_ago = datetime.now(UTC) - timedelta(hours=1)
    for i in range(600):
        obj: dict[str, Any] = copy.deepcopy(slice_)
        obj["endpoints"][0]["addresses"] = [f"10.244.{3 + i // 250}.{1 + i % 250}"]
        when = hour_ago if i == 0 else datetime.now(UTC)
        obj["metadata"].setdefault("annotations", {})[TRIGGER_ANNOTATION] = when.strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        )
        api.apply(obj)
        if i % 50 == 0:
            _retry(agent, clock)
    slices = source.informers[1]
    wait_for(lambda: slices.resource_version == str(api.resource_version()), 10, "the last change")
    _retry(agent, clock)
    assert agent.stats.syncs == 0 and agent.stats.sync_errors >= 12
    dp.failing = None  # room in the map again
    _retry(agent, clock)
    assert agent.stats.syncs == 1
    (done,) = [r for r in reports if r.ok]
    assert 1 <= len(done.latencies) <= 4, f"{len(done.latencies)} latencies for 4 objects"
    assert max(done.latencies) >= 3600, "the oldest change (an hour ago) was not kept"
    assert {str(lb) for lb in dp.state.services} == {"203.0.113.10", "203.0.113.20"}


def test_changes_of_more_objects_than_kept_count_as_one_the_oldest(
    api: FakeKubeAPI, source: KubeSource, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Objects that come and go under new names while writes fail (a tenant's loop of create
    and delete) are more objects, not more changes of one: past TRIGGERS_MAX objects (here 20)
    the changes of the others count as one, the oldest of them. 150 Services created and
    deleted (300 objects with their slices) leave at most 21 latencies, the longest the first
    change's."""
    import cozyebpf.sources

    monkeypatch.setattr(cozyebpf.sources, "TRIGGERS_MAX", 20, raising=False)
    put(api, VM1)
    agent, dp, clock, reports = _failing_agent(source)
    listed = time.time()  # vm1's changes (the list) were made before
    for i in range(150):
        svc = Svc(f"churn-{i}", f"203.0.113.{100 + i % 100}", f"10.244.9.{1 + i % 250}")
        put(api, svc)
        api.delete("EndpointSlice", "default", objects(svc)[1]["metadata"]["name"])
        api.delete("Service", "default", svc.name)
        if i % 30 == 0:
            _retry(agent, clock)
    services = source.informers[0]
    wait_for(lambda: not any(k[1].startswith("churn") for k in services.cache), 10, "the deletes")
    slices = source.informers[1]
    wait_for(lambda: not any(k[1].startswith("churn") for k in slices.cache), 10, "the deletes")
    _retry(agent, clock)
    dp.failing = None
    writing = time.time()
    _retry(agent, clock)
    (done,) = [r for r in reports if r.ok]
    assert 1 <= len(done.latencies) <= 21, f"{len(done.latencies)} latencies kept"
    assert max(done.latencies) >= writing - listed, "the oldest change (vm1's) was not kept"


def test_paginated_lists_are_complete(api: FakeKubeAPI) -> None:
    svcs = [Svc(f"vm{i}", f"203.0.113.{i + 1}", f"10.244.2.{i + 1}") for i in range(7)]
    put(api, *svcs)
    src = KubeSource(api.api_client(), "cozy-proxy", watch_timeout=5, request_timeout=5)
    for inf in src.informers:
        inf.page_size = 3
    src.start()
    try:
        taken = Taken(src)
        wait_for(taken.take, 5, "the list")
        assert len(taken.names()) == 7
        assert max(int(q.get("limit", 0)) for q in lists(api, "/services")) == 3
        assert any(q.get("continue") for q in lists(api, "/services"))
    finally:
        src.stop()


def problem(name: str, message: str) -> Problem:
    return Problem(ObjectRef("Service", "default", name), message, "warning")


def test_events_are_created_once_then_counted(api: FakeKubeAPI) -> None:
    rec = EventRecorder(api.api_client(), "node-a")
    rec.start()
    try:
        p = problem("vm2", "LB IP 203.0.113.10 is claimed by the older Service default/vm1")
        rec.record([p])
        wait_for(lambda: rec.sent == 1, 5, "the event")
        (ev,) = api.events("default")
        assert ev["metadata"]["name"] == event_name(p, "node-a")
        assert ev["involvedObject"] == {
            "apiVersion": "v1",
            "kind": "Service",
            "namespace": "default",
            "name": "vm2",
        }
        assert (ev["type"], ev["reason"], ev["count"]) == ("Warning", "CozyebpfWarning", 1)
        assert ev["message"] == p.message and ev["source"] == {
            "component": "cozyebpf",
            "host": "node-a",
        }
        rec.record([p])
        wait_for(lambda: rec.sent == 2, 5, "the repeat")
        (ev,) = api.events("default")
        assert ev["count"] == 2
    finally:
        rec.stop()
    # a new recorder (agent restart) continues the count instead of failing on 409, with the
    # rights the chart grants on events (create, patch) and no `get`: the real API server
    # answers a get 403 (the labs saw it: tests/datapath/test_cluster_lab.py)
    rec2 = EventRecorder(api.api_client(), "node-a")
    rec2.start()
    try:
        rec2.record([p])
        wait_for(lambda: rec2.sent == 1, 5, "the event after a restart")
        assert [e["count"] for e in api.events("default")] == [3]
    finally:
        rec2.stop()
    verbs = {r.method for r in api.requests if "/events" in r.path}
    assert verbs == {"POST", "PATCH"}, verbs


def test_a_forbidden_event_names_the_right_and_the_cluster_role(
    api: FakeKubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    rec = EventRecorder(api.api_client(), "node-a", cluster_role="cozy-proxy")
    rec.start()
    api.forbid("events")
    try:
        rec.record([problem("vm3", "something")])
        wait_for(lambda: "could not record" in caplog.text, 5, "the failure logged")
    finally:
        rec.stop()
    assert rec.failed == 1
    assert (
        "could not record an Event for Service default/vm3: HTTP 403 Forbidden: the "
        'ClusterRole cozy-proxy does not grant `create` on events (API group ""); add it'
    ) in caplog.text


def test_a_forbidden_list_or_watch_names_the_right_and_the_cluster_role(
    api: FakeKubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    """A resource the agent needs (EndpointSlices): the error names the verb, the resource,
    its API group and the ClusterRole, and the source waits for it; one it can do without
    (Nodes): the same, and what the agent goes without."""
    put(api, VM1)
    api.forbid("endpointslices")
    api.forbid("nodes")
    src = KubeSource(
        api.api_client(),
        "cozy-proxy",
        watch_timeout=5,
        request_timeout=5,
        cluster_role="cozy-proxy",
    )
    for inf in src.informers:
        inf.backoff = Backoff(base=0.05, cap=0.2)
    src.start()
    try:
        wait_for(
            lambda: (
                "listing EndpointSlices is forbidden" in caplog.text
                and "listing Nodes is forbidden" in caplog.text
            ),
            5,
            "both errors (each informer logs its own, on its own thread)",
        )
        assert not src.synced and src.take() is None
        assert (
            "listing EndpointSlices is forbidden (HTTP 403 Forbidden: the ClusterRole "
            "cozy-proxy does not grant `list` on endpointslices (API group "
            '"discovery.k8s.io"); add it'
        ) in caplog.text
        assert (
            "listing Nodes is forbidden, so no LB IP is checked against the Nodes' addresses: "
            "HTTP 403 Forbidden: the ClusterRole cozy-proxy does not grant `list` on nodes "
            '(API group ""); add it'
        ) in caplog.text
        api.forbid("endpointslices", False)
        wait_for(lambda: src.synced, 5, "the sync once the right is there")
    finally:
        src.stop()


def test_event_failures_are_logged_not_fatal(
    api: FakeKubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    rec = EventRecorder(api.api_client(), "node-a")
    rec.start()
    try:
        api.fail_next(1, 500, paths="/events")
        rec.record([problem("vm3", "something"), problem("vm4", "else")])
        wait_for(lambda: rec.failed == 1 and rec.sent == 1, 5, "one failure, one success")
        assert "could not record an Event for Service default/vm3: HTTP 500" in caplog.text
    finally:
        rec.stop()


def test_an_lb_ip_shared_with_an_unmanaged_service_is_warned_about(
    api: FakeKubeAPI, source: KubeSource
) -> None:
    """Cilium programs (and drops unlisted ports of) the LB IP of every Service it handles:
    a managed LB IP that an unlabelled Service also holds gets a warning (a Problem, which the
    agent logs) and an Event on the managed Service; an unmanaged Service with its own IP gets
    nothing."""
    rec = EventRecorder(api.api_client(), "node-a")
    rec.start()
    dp = FakeDatapath()
    agent = Agent(source, dp, on_problems=rec.record)
    unlabelled = Svc("web", VM1.lb_ip, "10.244.1.99", [("TCP", 443)])
    put(api, VM1, VM2, OTHER)  # OTHER: another proxy's Service on its own IP
    web = objects(unlabelled)[0]
    del web["metadata"]["labels"]["service.kubernetes.io/service-proxy-name"]
    source.start(agent.notify)
    try:
        wait_for(lambda: source.synced, 5, "the lists")
        agent.tick()
        assert agent.model.problems() == []
        assert not [e for e in api.events("default") if "LoadBalancer IP" in e["message"]]
        api.apply(web)
        wait_for(lambda: (agent.tick(), agent.model.problems())[1], 5, "the warning")
        message = (
            "LoadBalancer IP 203.0.113.10 is also the LoadBalancer IP of Service default/web, "
            "which has no service.kubernetes.io/service-proxy-name label, so the cluster's own "
            "Service proxy programs it (Cilium adds a wildcard entry for the IP that drops "
            "ports that Service does not list); traffic to the IP may not reach this Service's "
            "pod: give each Service its own LoadBalancer IP"
        )
        assert agent.model.problems() == [problem("vm1", message)]
        wait_for(lambda: rec.sent >= 1, 5, "the Event")
        (ev,) = [e for e in api.events("default") if e["involvedObject"]["name"] == "vm1"]
        assert ev["message"] == message and ev["reason"] == "CozyebpfWarning"
        # the managed Service stays programmed, and the warning goes with the shared IP
        services = build_dump(dp.state)["services"]
        assert [s["lb_ip"] for s in services] == ["203.0.113.10", "203.0.113.20"]
        api.delete("Service", "default", "web")
        wait_for(lambda: (agent.tick(), not agent.model.problems())[1], 5, "the warning to go")
    finally:
        rec.stop()


def test_the_trigger_time_of_a_change_is_read_from_the_endpointslice() -> None:
    from cozyebpf.sources.kube import TRIGGER_ANNOTATION, trigger_time

    obj: dict[str, Any] = {
        "metadata": {"annotations": {TRIGGER_ANNOTATION: "2026-11-30T10:00:00Z"}}
    }
    assert trigger_time(obj) == 1796032800.0
    assert trigger_time({"metadata": {}}) is None
    obj["metadata"]["annotations"][TRIGGER_ANNOTATION] = "yesterday"
    assert trigger_time(obj) is None


def test_an_invalid_source_range_is_an_event_and_the_valid_ones_apply(
    api: FakeKubeAPI, source: KubeSource
) -> None:
    """loadBalancerSourceRanges with a bad CIDR among good ones: a Warning Event on the Service
    names the value; the valid ranges are programmed."""
    rec = EventRecorder(api.api_client(), "node-a")
    rec.start()
    dp = FakeDatapath()
    agent = Agent(source, dp, on_problems=rec.record)
    ranged = Svc(
        "vm1",
        VM1.lb_ip,
        VM1.pod_ip,
        VM1.ports,
        whole_ip="true",
        source_ranges=["198.51.100.0/24", "198.51.100.300/32"],
    )
    put(api, ranged)
    source.start(agent.notify)
    try:
        wait_for(lambda: source.synced, 5, "the lists")
        agent.tick()
        wait_for(lambda: rec.sent >= 1, 5, "the Event")
        (ev,) = [e for e in api.events("default") if e["involvedObject"]["name"] == "vm1"]
        assert ev["type"] == "Warning" and "198.51.100.300/32" in ev["message"], ev
        assert "loadBalancerSourceRanges" in ev["message"]
        (svc,) = build_dump(dp.state)["services"]
        assert svc["source_ranges"] == ["198.51.100.0/24"]
    finally:
        rec.stop()


# -- trusted endpoints (issue 28, item 2) ------------------------------------------------------

#: whole-IP Services whose endpoints a tenant could forge: a slice of no controller, an
#: endpoint that is a Pod of another namespace, one with no Pod at all (the API server's IP)
FORGED = (
    Svc("by-hand", "203.0.113.41", "10.244.9.41", whole_ip="true", managed_by=None),
    Svc(
        "other-ns",
        "203.0.113.42",
        "10.244.9.42",
        whole_ip="true",
        target={"kind": "Pod", "namespace": "tenant-b", "name": "victim"},
    ),
    Svc("no-pod", "203.0.113.43", "10.96.0.1", whole_ip="true", target=None),
)
SETTING = "--trusted-endpoints any (the chart's agent.trustedEndpoints: any)"


def _agent_on(api: FakeKubeAPI, **kw: Any) -> tuple[KubeSource, Agent, FakeDatapath]:
    src = KubeSource(api.api_client(), "cozy-proxy", watch_timeout=5, request_timeout=5, **kw)
    for inf in src.informers:
        inf.backoff = Backoff(base=0.05, cap=0.2)
    dp = FakeDatapath()
    return src, Agent(src, dp), dp


def test_forged_endpoints_are_not_programmed_and_say_why(api: FakeKubeAPI) -> None:
    """By default only EndpointSlices of Kubernetes' EndpointSlice controller, and endpoints
    that are Pods of the Service's namespace, are programmed; anything else gets a Warning
    Event on its Service naming why and the setting that allows it."""
    put(api, VM1, *FORGED)
    src, agent, dp = _agent_on(api)
    rec = EventRecorder(api.api_client(), "node-a")
    agent.on_problems = rec.record
    rec.start()
    src.start(agent.notify)
    try:
        wait_for(lambda: (agent.tick(), src.synced and agent.synced_once)[1], 5, "the sync")
        assert [s["lb_ip"] for s in build_dump(dp.state)["services"]] == [VM1.lb_ip]
        assert [str(p) for p in dp.state.pods] == [VM1.pod_ip]
        # the warnings are the slices' (an Event on each); their Services have no ready
        # endpoint, which is said on the Service as for any Service without one
        problems = agent.model.problems()
        why = {p.ref.name: p.message for p in problems if p.ref.kind == "EndpointSlice"}
        assert sorted(why) == ["by-hand-ipv4", "no-pod-ipv4", "other-ns-ipv4"]
        assert {p.ref.name for p in problems if p.ref.kind == "Service"} == {
            "by-hand",
            "no-pod",
            "other-ns",
        }
        assert why["by-hand-ipv4"] == (
            "is managed by no controller (no label), not by Kubernetes' EndpointSlice "
            "controller (endpointslice.kubernetes.io/managed-by: endpointslice-controller.k8s.io"
            "), so its endpoints are not programmed: a slice written by hand could point the "
            "Service's LB IP at any address of the cluster; if this platform writes "
            f"EndpointSlices itself, set {SETTING}"
        )
        assert why["other-ns-ipv4"].startswith(
            "endpoints[0] (10.244.9.42) is not a Pod of the namespace default (its targetRef "
            'names a Pod of the namespace "tenant-b"), so it is not programmed'
        )
        assert why["no-pod-ipv4"].startswith(
            "endpoints[0] (10.96.0.1) is not a Pod of the namespace default (its targetRef "
            "names nothing), so it is not programmed"
        )
        assert all(m.endswith(SETTING) for m in why.values()), why
        wait_for(lambda: rec.sent >= 6, 5, "the Events")
        events = {
            e["involvedObject"]["name"]: e
            for e in api.events("default")
            if e["involvedObject"]["kind"] == "EndpointSlice"
        }
        assert sorted(events) == sorted(why)
        assert all(e["type"] == "Warning" and SETTING in e["message"] for e in events.values())
    finally:
        src.stop()
        rec.stop()


def test_the_setting_trusts_any_endpoints(api: FakeKubeAPI) -> None:
    """--trusted-endpoints any: slices and endpoints are taken as written (a platform that
    writes its own)."""
    put(api, VM1, *FORGED)
    src, agent, dp = _agent_on(api, trust_any_endpoints=True)
    src.start(agent.notify)
    try:
        wait_for(lambda: (agent.tick(), src.synced and agent.synced_once)[1], 5, "the sync")
        lbs = [s["lb_ip"] for s in build_dump(dp.state)["services"]]
        assert lbs == sorted([VM1.lb_ip, *(s.lb_ip for s in FORGED)])
        assert agent.model.problems() == []
    finally:
        src.stop()
