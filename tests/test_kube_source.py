"""The Kubernetes source (informers on the official client) and the Event recorder, against
the API server double in tests/kubeapi.py: list then watch from the list's resourceVersion,
resume after a dropped watch, relist on 410, keep the last state through an outage."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from cozyebpf.agent import Agent
from cozyebpf.datapath.fake import FakeDatapath
from cozyebpf.errors import SourceError
from cozyebpf.events import EventRecorder, event_name
from cozyebpf.model import ObjectRef, Problem
from cozyebpf.sources.kube import Backoff, KubeSource
from tests.k8s import Svc, objects
from tests.kubeapi import FakeKubeAPI
from tests.labtools import wait_for

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


def names(src: KubeSource) -> set[str]:
    return {f"{o['kind']}/{o['metadata']['name']}" for o in src.load() if o["kind"] == "Service"}


def watches(api: FakeKubeAPI, path_part: str) -> list[dict[str, str]]:
    return [r.query for r in api.requests if path_part in r.path and r.query.get("watch")]


def lists(api: FakeKubeAPI, path_part: str) -> list[dict[str, str]]:
    return [r.query for r in api.requests if path_part in r.path and not r.query.get("watch")]


def test_nothing_is_reported_before_every_resource_is_listed(
    api: FakeKubeAPI, source: KubeSource
) -> None:
    put(api, VM1)
    api.fail_next(3, 503, paths="endpointslices")
    source.start()
    wait_for(lambda: source.informers[0].synced, 5, "services listed")
    assert not source.changed()
    with pytest.raises(SourceError, match="not listed yet: EndpointSlices"):
        source.load()
    wait_for(source.changed, 5, "both listed after the 503s")
    objs = source.load()
    assert sorted(o["kind"] for o in objs) == ["EndpointSlice", "Service"]
    assert all(o["apiVersion"] for o in objs)  # list items get kind and apiVersion back


def test_selects_by_label_and_watches_from_the_list_resource_version(
    api: FakeKubeAPI, source: KubeSource
) -> None:
    put(api, VM1, OTHER)
    rv_at_list = api.resource_version()
    source.start()
    wait_for(source.changed, 5, "the first list")
    assert names(source) == {"Service/vm1"}
    svc_lists = lists(api, "/services")
    assert svc_lists[0]["labelSelector"] == "service.kubernetes.io/service-proxy-name=cozy-proxy"
    first_watch = wait_for(lambda: watches(api, "/services"), 5, "a watch")[0]
    assert first_watch["allowWatchBookmarks"] == "true"
    assert first_watch["resourceVersion"] == str(rv_at_list)  # no gap, no replay
    put(api, VM2)
    wait_for(source.changed, 5, "the watch event")
    assert names(source) == {"Service/vm1", "Service/vm2"}
    api.delete("Service", "default", "vm1")
    wait_for(source.changed, 5, "the delete")
    assert names(source) == {"Service/vm2"}
    assert [inf.lists for inf in source.informers] == [1, 1]  # no relist needed


def test_a_dropped_watch_resumes_without_a_relist(api: FakeKubeAPI, source: KubeSource) -> None:
    put(api, VM1)
    source.start()
    wait_for(source.changed, 5, "the first list")
    source.load()
    wait_for(lambda: api.open_watches() == 2, 5, "two watches")
    rv_before = source.informers[0].resource_version
    assert api.drop_watches() == 2
    put(api, VM2)
    wait_for(source.changed, 5, "the change after the drop")
    assert names(source) == {"Service/vm1", "Service/vm2"}
    assert [inf.lists for inf in source.informers] == [1, 1]
    resumed = [int(q["resourceVersion"]) for q in watches(api, "/services")]
    assert resumed[-1] >= int(rv_before or 0) and len(resumed) >= 2


def test_410_gone_relists(api: FakeKubeAPI, source: KubeSource) -> None:
    put(api, VM1)
    source.start()
    wait_for(source.changed, 5, "the first list")
    source.load()
    wait_for(lambda: api.open_watches() == 2, 5, "two watches")
    api.stop()  # the watches break while the history moves on and is compacted
    put(api, VM2)
    api.delete("Service", "default", "vm1")
    api.compact()
    api.start()
    wait_for(lambda: source.informers[0].lists >= 2, 10, "a relist after 410")
    wait_for(source.changed, 5, "the new state")
    assert names(source) == {"Service/vm2"}


def test_outage_keeps_the_last_state_then_converges(
    api: FakeKubeAPI, source: KubeSource, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "cozyebpf.sources.kube")
    put(api, VM1)
    source.start()
    wait_for(source.changed, 5, "the first list")
    assert names(source) == {"Service/vm1"}
    api.set_down(True)
    wait_for(lambda: "keeping the last known state" in caplog.text, 10, "a retry warning")
    assert names(source) == {"Service/vm1"}  # fail-static
    put(api, VM2)
    api.set_down(False)
    wait_for(lambda: names(source) == {"Service/vm1", "Service/vm2"}, 10, "convergence")


def test_agent_programs_only_after_a_complete_list(api: FakeKubeAPI, source: KubeSource) -> None:
    """An agent starting during an outage must not wipe the pinned state with nothing."""
    from cozyebpf.state import MapState

    dp = FakeDatapath()
    put(api, VM1)
    agent = Agent(source, dp)
    pinned: dict[str, Any] = dp.dump()
    api.set_down(True)
    source.start()
    agent.tick()
    assert dp.dump() == pinned and agent.readiness() == "not synced yet"
    api.set_down(False)
    wait_for(source.changed, 10, "the list")
    agent.tick()
    assert [s["lb_ip"] for s in dp.dump()["services"]] == ["203.0.113.10"]
    assert agent.readiness() is None
    assert isinstance(dp.state, MapState)


def test_paginated_lists_are_complete(api: FakeKubeAPI) -> None:
    svcs = [Svc(f"vm{i}", f"203.0.113.{i + 1}", f"10.244.2.{i + 1}") for i in range(7)]
    put(api, *svcs)
    src = KubeSource(api.api_client(), "cozy-proxy", watch_timeout=5, request_timeout=5)
    for inf in src.informers:
        inf.page_size = 3
    src.start()
    try:
        wait_for(src.changed, 5, "the list")
        assert len(names(src)) == 7
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
    # a new recorder (agent restart) continues the count instead of failing on 409
    rec2 = EventRecorder(api.api_client(), "node-a")
    rec2.start()
    try:
        rec2.record([p])
        wait_for(lambda: rec2.sent == 1, 5, "the event after a restart")
        assert [e["count"] for e in api.events("default")] == [3]
    finally:
        rec2.stop()


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
