"""FakeKubeAPI checked with the real `kubernetes` client: what the client sees is what a
kube-apiserver would show it, and the injected faults look to the client like the real ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import urllib3
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from cozylab.kubeapi import FakeKubeAPI

NS = "demo"
# Every watch in this file is bounded on both sides: the server ends it, the client gives up.
BOUNDED = {"timeout_seconds": 5, "_request_timeout": 10}


def service(name: str, ns: str = NS, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {"type": "LoadBalancer", "ports": [{"port": 80, "protocol": "TCP"}]},
    }


def endpoint_slice(name: str, svc: str, ip: str) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": svc},
        },
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
        "ports": [{"port": 80, "protocol": "TCP"}],
    }


def event(name: str, count: int = 1, stamp: str = "2026-01-01T00:00:00Z") -> client.CoreV1Event:
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=name, namespace=NS),
        involved_object=client.V1ObjectReference(kind="Service", namespace=NS, name="web"),
        reason="Programmed",
        message="NAT 192.0.2.10 -> 10.0.0.1",
        type="Normal",
        count=count,
        first_timestamp=stamp,
        last_timestamp=stamp,
        source=client.V1EventSource(component="cozyebpf"),
    )


def status_of(exc: ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(exc.body)
    return body


def watch_requests(api: FakeKubeAPI) -> list[dict[str, str]]:
    return [r.query for r in api.requests if r.query.get("watch") == "true"]


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_interval=0.2) as server:
        yield server


@pytest.fixture
def core(api: FakeKubeAPI) -> Iterator[client.CoreV1Api]:
    with api.api_client() as api_client:
        yield client.CoreV1Api(api_client)


@pytest.fixture
def discovery(api: FakeKubeAPI) -> Iterator[client.DiscoveryV1Api]:
    with api.api_client() as api_client:
        yield client.DiscoveryV1Api(api_client)


# --- lists ---------------------------------------------------------------------------------------


@pytest.fixture
def labelled(api: FakeKubeAPI) -> None:
    api.apply(service("a", "ns1", {"app": "web", "tier": "front"}))
    api.apply(service("b", "ns2", {"app": "web"}))
    api.apply(service("c", "ns1", {"app": "db", "tier": "back"}))
    api.apply(service("d", "ns1"))


@pytest.mark.parametrize(
    ("selector", "names"),
    [
        ("", ["a", "c", "d", "b"]),  # etcd key order: namespace, then name
        ("app=web", ["a", "b"]),
        ("app==web", ["a", "b"]),
        ("app!=web", ["c", "d"]),
        ("tier", ["a", "c"]),
        ("!tier", ["d", "b"]),
        ("app=web,tier", ["a"]),
        ("app in (web,db)", ["a", "c", "b"]),
        ("app notin (web)", ["c", "d"]),
    ],
    ids=lambda v: repr(v) if isinstance(v, str) else None,
)
def test_list_with_label_selector(
    labelled: None, core: client.CoreV1Api, selector: str, names: list[str]
) -> None:
    got = core.list_service_for_all_namespaces(label_selector=selector)
    assert [s.metadata.name for s in got.items] == names


def test_list_namespaced_and_a_bad_selector(labelled: None, core: client.CoreV1Api) -> None:
    assert [
        s.metadata.name for s in core.list_namespaced_service("ns1", label_selector="app").items
    ] == ["a", "c"]
    with pytest.raises(ApiException) as bad:
        core.list_service_for_all_namespaces(label_selector="app=(web")
    assert (bad.value.status, status_of(bad.value)["reason"]) == (400, "BadRequest")


def test_list_wire_format(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    stored = api.apply(service("web"))
    assert stored["metadata"]["uid"] and stored["metadata"]["creationTimestamp"]
    raw = core.list_namespaced_service(NS, _preload_content=False)
    body = json.loads(raw.data)
    assert body["kind"] == "ServiceList" and body["apiVersion"] == "v1"
    assert body["metadata"] == {"resourceVersion": str(api.resource_version())}
    assert "kind" not in body["items"][0] and "apiVersion" not in body["items"][0]
    assert body["items"][0]["metadata"] == stored["metadata"]
    one = core.read_namespaced_service("web", NS)
    assert (one.kind, one.api_version, one.metadata.uid) == (
        "Service",
        "v1",
        stored["metadata"]["uid"],
    )


def test_given_creation_timestamp_kept_and_noop_apply(api: FakeKubeAPI) -> None:
    obj = service("web")
    obj["metadata"]["creationTimestamp"] = "2020-02-02T02:02:02Z"
    first = api.apply(obj)
    assert first["metadata"]["creationTimestamp"] == "2020-02-02T02:02:02Z"
    rv = api.resource_version()
    assert api.apply(service("web")) == first  # nothing changed: no new resourceVersion
    assert api.resource_version() == rv


def test_get_missing_is_404_status(core: client.CoreV1Api) -> None:
    with pytest.raises(ApiException) as e:
        core.read_namespaced_service("nope", NS)
    assert e.value.status == 404
    assert status_of(e.value) == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": 'services "nope" not found',
        "reason": "NotFound",
        "details": {"name": "nope", "kind": "services"},
        "code": 404,
    }


def test_paginated_list_is_a_consistent_snapshot(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    for i in range(5):
        api.apply(service(f"s{i}", labels={"gen": "1"}))
    page1 = core.list_namespaced_service(NS, limit=2)
    token = page1.metadata.var_continue
    assert [s.metadata.name for s in page1.items] == ["s0", "s1"]
    assert token and page1.metadata.remaining_item_count == 3

    # writes between pages must not show in the later pages
    api.apply(service("s00"))
    api.delete("Service", NS, "s3")
    api.apply(service("s4", labels={"gen": "2"}))

    page2 = core.list_namespaced_service(NS, limit=2, _continue=token)
    assert [s.metadata.name for s in page2.items] == ["s2", "s3"]
    assert page2.metadata.resource_version == page1.metadata.resource_version
    assert page2.metadata.remaining_item_count == 1
    page3 = core.list_namespaced_service(NS, limit=2, _continue=page2.metadata.var_continue)
    assert [(s.metadata.name, s.metadata.labels) for s in page3.items] == [("s4", {"gen": "1"})]
    assert page3.metadata.var_continue is None and page3.metadata.remaining_item_count is None

    fresh = core.list_namespaced_service(NS)
    assert [s.metadata.name for s in fresh.items] == ["s0", "s00", "s1", "s2", "s4"]
    assert int(fresh.metadata.resource_version) > int(page1.metadata.resource_version)

    # with a selector the remaining count is unknown (as in the real API)
    selected = core.list_namespaced_service(NS, limit=2, label_selector="gen")
    assert selected.metadata.var_continue and selected.metadata.remaining_item_count is None

    api.compact()  # the snapshot's resourceVersion is gone: the token has expired
    for stale in (token, "not-a-token"):
        with pytest.raises(ApiException) as e:
            core.list_namespaced_service(NS, limit=2, _continue=stale)
        assert (e.value.status, status_of(e.value)["reason"]) == (410, "Expired")


def test_endpointslices_list_and_watch(api: FakeKubeAPI, discovery: client.DiscoveryV1Api) -> None:
    api.apply(endpoint_slice("web-abc", "web", "10.0.0.1"))
    api.apply(endpoint_slice("db-xyz", "db", "10.0.0.2"))
    listed = discovery.list_endpoint_slice_for_all_namespaces(
        label_selector="kubernetes.io/service-name=web"
    )
    assert [(s.metadata.name, s.endpoints[0].addresses) for s in listed.items] == [
        ("web-abc", ["10.0.0.1"])
    ]
    raw = json.loads(discovery.list_namespaced_endpoint_slice(NS, _preload_content=False).data)
    assert (raw["kind"], raw["apiVersion"]) == ("EndpointSliceList", "discovery.k8s.io/v1")

    w = watch.Watch()
    seen = []
    stream = w.stream(
        discovery.list_namespaced_endpoint_slice,
        NS,
        resource_version=listed.metadata.resource_version,
        **BOUNDED,
    )
    api.apply(endpoint_slice("web-abc", "web", "10.0.0.9"))
    for e in stream:
        seen.append(e)
        w.stop()
    assert [e["type"] for e in seen] == ["MODIFIED"]
    assert isinstance(seen[0]["object"], client.V1EndpointSlice)
    assert seen[0]["object"].endpoints[0].addresses == ["10.0.0.9"]
    assert seen[0]["raw_object"]["kind"] == "EndpointSlice"


# --- watches -------------------------------------------------------------------------------------


def test_watch_from_list_resource_version(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    api.apply(service("early"))
    listed = core.list_namespaced_service(NS)
    rv = listed.metadata.resource_version
    api.apply(service("b"))  # after the list: replayed from history
    api.apply(service("early", labels={"v": "2"}))

    w = watch.Watch()
    seen = []
    for e in w.stream(core.list_namespaced_service, NS, resource_version=rv, **BOUNDED):
        obj = e["object"]
        seen.append((e["type"], obj.metadata.name, int(obj.metadata.resource_version)))
        if len(seen) == 2:  # history replayed; now live changes
            api.delete("Service", NS, "b")
            api.apply(service("c"))
        if len(seen) == 4:
            w.stop()
    assert [s[:2] for s in seen] == [
        ("ADDED", "b"),
        ("MODIFIED", "early"),
        ("DELETED", "b"),
        ("ADDED", "c"),
    ]
    rvs = [s[2] for s in seen]
    assert rvs == sorted(set(rvs)) and rvs[0] > int(rv)
    assert watch_requests(api)[-1]["resourceVersion"] == rv


@pytest.mark.parametrize("resource_version", ["0", None], ids=["rv-0", "rv-absent"])
def test_watch_without_resource_version_replays_state(
    api: FakeKubeAPI, core: client.CoreV1Api, resource_version: str | None
) -> None:
    a = api.apply(service("a"))
    b = api.apply(service("b"))
    kw: dict[str, Any] = {} if resource_version is None else {"resource_version": resource_version}
    w = watch.Watch()
    seen = []
    for e in w.stream(core.list_namespaced_service, NS, **kw, **BOUNDED):
        seen.append((e["type"], e["object"].metadata.name, e["object"].metadata.resource_version))
        if len(seen) == 2:
            api.apply(service("c"))
        if len(seen) == 3:
            w.stop()
    rv_a, rv_b = a["metadata"]["resourceVersion"], b["metadata"]["resourceVersion"]
    assert seen == [("ADDED", "a", rv_a), ("ADDED", "b", rv_b), ("ADDED", "c", str(int(rv_b) + 1))]
    assert ("resourceVersion" in watch_requests(api)[0]) == (resource_version is not None)


def test_watch_selector_change_adds_and_deletes(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    api.apply(service("x", labels={"app": "b"}))
    rv = core.list_namespaced_service(NS, label_selector="app=a").metadata.resource_version
    api.apply(service("x", labels={"app": "a"}))  # starts matching
    then = iter(
        [
            lambda: api.apply(service("x", labels={"app": "a", "v": "2"})),  # still matches
            lambda: api.apply(service("x", labels={"app": "b"})),  # stops matching
            lambda: (api.delete("Service", NS, "x"), api.apply(service("y", labels={"app": "a"}))),
        ]
    )
    w = watch.Watch()
    seen = []
    stream = w.stream(
        core.list_namespaced_service, NS, label_selector="app=a", resource_version=rv, **BOUNDED
    )
    for e in stream:
        obj = e["raw_object"]
        seen.append((e["type"], obj["metadata"]["name"], obj["metadata"]["labels"]))
        if (step := next(then, None)) is not None:
            step()
        else:
            w.stop()
    assert seen == [
        ("ADDED", "x", {"app": "a"}),
        ("MODIFIED", "x", {"app": "a", "v": "2"}),
        ("DELETED", "x", {"app": "a", "v": "2"}),  # last state it matched in
        ("ADDED", "y", {"app": "a"}),  # x's deletion (no longer matching) is not sent
    ]


def test_bookmarks_carry_current_resource_version(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    api.apply(service("a"))
    rv = api.resource_version()
    w = watch.Watch()
    seen = []
    stream = w.stream(
        core.list_namespaced_service,
        NS,
        resource_version=str(rv),
        allow_watch_bookmarks=True,
        timeout_seconds=1,
        _request_timeout=10,
    )
    for e in stream:  # ends by itself when the server times the watch out
        seen.append(e)
        if len(seen) == 1:  # another kind moves the global resourceVersion
            api.apply(endpoint_slice("web-abc", "web", "10.0.0.1"))
    assert all(e["type"] == "BOOKMARK" for e in seen)
    assert seen[0]["raw_object"] == {
        "kind": "Service",
        "apiVersion": "v1",
        "metadata": {"resourceVersion": str(rv)},
    }
    assert seen[-1]["raw_object"]["metadata"]["resourceVersion"] == str(rv + 1)
    assert w.resource_version == str(rv + 1)  # the client resumes from bookmarks
    assert 3 <= len(seen) <= 7  # every 0.2 s for 1 s, plus one at the timeout

    w = watch.Watch()
    plain = list(w.stream(core.list_namespaced_service, NS, timeout_seconds=1, _request_timeout=5))
    assert [e["type"] for e in plain] == ["ADDED"]  # no bookmarks unless asked for


def test_watch_on_compacted_resource_version_is_410(
    api: FakeKubeAPI, core: client.CoreV1Api
) -> None:
    api.apply(service("a"))
    old = core.list_namespaced_service(NS).metadata.resource_version
    api.apply(service("b"))
    api.compact()
    horizon = api.resource_version()
    expected = f"Expired: too old resource version: {old} ({horizon})"

    # the server answers 200 and then one ERROR event
    raw = core.list_namespaced_service(NS, watch=True, resource_version=old, _preload_content=False)
    assert raw.status == 200
    lines = raw.data.decode().splitlines()
    assert [json.loads(line) for line in lines] == [
        {
            "type": "ERROR",
            "object": {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Failure",
                "message": f"too old resource version: {old} ({horizon})",
                "reason": "Expired",
                "code": 410,
            },
        }
    ]

    # Watch.stream turns it into ApiException(410), at once when timeout_seconds is given...
    before = len(watch_requests(api))
    with pytest.raises(ApiException) as e:
        list(
            watch.Watch().stream(core.list_namespaced_service, NS, resource_version=old, **BOUNDED)
        )
    assert (e.value.status, e.value.reason) == (410, expected)
    assert len(watch_requests(api)) == before + 1
    # ...and after one retry from the same resourceVersion when it is not
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(core.list_namespaced_service, NS, resource_version=old))
    assert (e.value.status, e.value.reason) == (410, expected)
    assert [q["resourceVersion"] for q in watch_requests(api)[before + 1 :]] == [old, old]

    # the horizon itself is still watchable
    api.apply(service("c"))
    w = watch.Watch()
    seen = []
    for ev in w.stream(core.list_namespaced_service, NS, resource_version=str(horizon), **BOUNDED):
        seen.append((ev["type"], ev["object"].metadata.name))
        w.stop()
    assert seen == [("ADDED", "c")]


def test_drop_watches_breaks_the_client_stream(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    api.apply(service("a"))
    w = watch.Watch()
    seen = []
    with pytest.raises(urllib3.exceptions.ProtocolError) as e:
        for ev in w.stream(core.list_namespaced_service, NS):  # no timeout: client would resume
            seen.append(ev["type"])
            assert api.open_watches() == 1
            assert api.drop_watches() == 1
    assert isinstance(e.value.args[1], ConnectionResetError)
    assert seen == ["ADDED"]
    assert len(watch_requests(api)) == 1  # the client does not retry a broken connection
    assert api.open_watches() == 0
    assert [s.metadata.name for s in core.list_namespaced_service(NS).items] == ["a"]


# --- faults --------------------------------------------------------------------------------------


def test_fail_next(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    api.apply(service("a"))
    api.fail_next(1, 503)
    with pytest.raises(ApiException) as e:
        core.list_namespaced_service(NS)
    assert e.value.status == 503
    assert status_of(e.value)["reason"] == "ServiceUnavailable"
    assert len(core.list_namespaced_service(NS).items) == 1  # only the next one failed

    api.fail_next(2, 500, paths="/events")
    core.list_namespaced_service(NS)
    for _ in range(2):
        with pytest.raises(ApiException) as e:
            core.list_namespaced_event(NS)
        assert (e.value.status, status_of(e.value)["reason"]) == (500, "InternalError")
    core.list_namespaced_event(NS)

    api.fail_next(1, 429, paths="watch=true")
    with pytest.raises(ApiException) as e:
        list(watch.Watch().stream(core.list_namespaced_service, NS, **BOUNDED))
    assert e.value.status == 429


def test_set_down(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    api.apply(service("a"))
    core.list_namespaced_service(NS)  # leaves a kept-alive connection in the client's pool
    seen = 0
    with pytest.raises(urllib3.exceptions.ProtocolError):
        for _ in watch.Watch().stream(core.list_namespaced_service, NS, **BOUNDED):
            seen += 1
            api.set_down(True)  # cuts the open watch too
    assert seen == 1
    recorded = len(api.requests)
    # GET: urllib3 retries 3 times, then gives up
    with pytest.raises(urllib3.exceptions.MaxRetryError) as e:
        core.list_namespaced_service(NS)
    assert isinstance(e.value.reason, urllib3.exceptions.ProtocolError)
    # POST is not retried
    with pytest.raises(urllib3.exceptions.ProtocolError):
        core.create_namespaced_event(NS, event("web.1"))
    assert len(api.requests) == recorded
    api.set_down(False)
    assert len(core.list_namespaced_service(NS).items) == 1


def test_restart_keeps_state_and_port(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    api.apply(service("a"))
    rv = core.list_namespaced_service(NS).metadata.resource_version
    url = api.url
    api.stop()
    with pytest.raises(urllib3.exceptions.MaxRetryError) as e:
        core.list_namespaced_service(NS)
    assert isinstance(e.value.reason, urllib3.exceptions.NewConnectionError)  # refused
    api.apply(service("b"))  # written while the server is away
    assert api.start() == url
    w = watch.Watch()
    seen = []
    for ev in w.stream(core.list_namespaced_service, NS, resource_version=rv, **BOUNDED):
        seen.append((ev["type"], ev["object"].metadata.name))
        w.stop()
    assert seen == [("ADDED", "b")]  # resumed from before the restart


# --- events --------------------------------------------------------------------------------------


def test_events_create_conflict_patch_list(api: FakeKubeAPI, core: client.CoreV1Api) -> None:
    created = core.create_namespaced_event(NS, event("web.1"))
    assert created.metadata.uid and created.metadata.resource_version
    assert created.count == 1 and created.kind == "Event"

    with pytest.raises(ApiException) as e:
        core.create_namespaced_event(NS, event("web.1"))
    assert e.value.status == 409
    assert status_of(e.value)["reason"] == "AlreadyExists"
    assert status_of(e.value)["message"] == 'events "web.1" already exists'

    # the client's default for a dict body is a strategic merge patch
    later = "2026-01-01T00:05:00Z"
    patched = core.patch_namespaced_event("web.1", NS, {"count": 2, "lastTimestamp": later})
    assert patched.count == 2 and patched.last_timestamp.isoformat() == "2026-01-01T00:05:00+00:00"
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    assert patched.metadata.uid == created.metadata.uid and patched.reason == "Programmed"
    merged = core.patch_namespaced_event(
        "web.1", NS, {"count": 3}, _content_type="application/merge-patch+json"
    )
    assert merged.count == 3 and merged.last_timestamp == patched.last_timestamp

    with pytest.raises(ApiException) as e:
        core.patch_namespaced_event("web.2", NS, {"count": 2})
    assert (e.value.status, status_of(e.value)["reason"]) == (404, "NotFound")
    with pytest.raises(ApiException) as e:  # optimistic concurrency
        stale = {"metadata": {"resourceVersion": created.metadata.resource_version}, "count": 9}
        core.patch_namespaced_event("web.1", NS, stale)
    assert (e.value.status, status_of(e.value)["reason"]) == (409, "Conflict")
    with pytest.raises(ApiException) as e:
        core.patch_namespaced_event("web.1", NS, [{"op": "replace", "path": "/count", "value": 4}])
    assert e.value.status == 415

    other = event("db.1")
    other.metadata.namespace = "other"
    core.create_namespaced_event("other", other)
    listed = core.list_namespaced_event(NS)
    assert [(ev.metadata.name, ev.count) for ev in listed.items] == [("web.1", 3)]
    everywhere = core.list_event_for_all_namespaces()
    assert [ev.metadata.name for ev in everywhere.items] == ["web.1", "db.1"]  # demo < other
    by_object = core.list_event_for_all_namespaces(field_selector="involvedObject.name=web")
    assert len(by_object.items) == 2
    assert [e["count"] for e in api.events(NS)] == [3]
    assert [e["metadata"]["namespace"] for e in api.events()] == ["demo", "other"]


def test_event_namespace_mismatch(core: client.CoreV1Api) -> None:
    body = event("unused")
    body.metadata = client.V1ObjectMeta(name="x", namespace="elsewhere")
    with pytest.raises(ApiException) as e:
        core.create_namespaced_event(NS, body)
    assert e.value.status == 400


# --- kubeconfig ---------------------------------------------------------------------------------


def test_kubeconfig(api: FakeKubeAPI, tmp_path: Path) -> None:
    api.apply(endpoint_slice("web-abc", "web", "10.0.0.1"))
    cfg = client.Configuration()
    config.load_kube_config(
        config_file=str(api.kubeconfig(tmp_path / "kubeconfig")), client_configuration=cfg
    )
    assert cfg.host == api.url
    with client.ApiClient(cfg) as api_client:
        slices = client.DiscoveryV1Api(api_client).list_endpoint_slice_for_all_namespaces()
        assert [s.metadata.name for s in slices.items] == ["web-abc"]


# --- pods and RBAC --------------------------------------------------------------------------------


def test_a_pod_is_read_with_its_annotations_and_forbid_answers_as_rbac(api: FakeKubeAPI) -> None:
    api.apply(
        {
            "kind": "Pod",
            "metadata": {
                "name": "virt-launcher-vm1-abcde",
                "namespace": NS,
                "annotations": {"ovn.kubernetes.io/port_security": "true"},
            },
        }
    )
    with api.api_client() as api_client:
        core = client.CoreV1Api(api_client)
        pod = core.read_namespaced_pod("virt-launcher-vm1-abcde", NS)
        assert pod.metadata.annotations == {"ovn.kubernetes.io/port_security": "true"}
        with pytest.raises(ApiException) as e:
            core.read_namespaced_pod("nope", NS)
        assert e.value.status == 404
        api.forbid("pods")
        with pytest.raises(ApiException) as e:
            core.read_namespaced_pod("virt-launcher-vm1-abcde", NS)
        assert e.value.status == 403
        assert json.loads(e.value.body)["message"] == (
            'pods "virt-launcher-vm1-abcde" is forbidden: User '
            '"system:serviceaccount:cozy-system:cozyebpf" cannot get resource "pods" in API '
            f'group "" in the namespace "{NS}"'
        )
        assert core.list_namespaced_service(NS).items == []  # other resources still answer
        api.forbid("pods", False)
        assert core.read_namespaced_pod("virt-launcher-vm1-abcde", NS).metadata.name


def test_a_pod_is_read_as_metadata_only_when_asked(api: FakeKubeAPI) -> None:
    """Accept: PartialObjectMetadata (the API server's metadata-only form) gives the object's
    metadata and nothing else; plain JSON the whole object."""
    from cozyebpf.kube.client import KubeRest
    from cozyebpf.kube.portsec import METADATA_ONLY

    api.apply(
        {
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": NS, "annotations": {"a": "b"}},
            "spec": {"containers": [{"name": "c", "env": [{"name": "SECRET", "value": "x"}]}]},
        }
    )
    with api.api_client() as api_client:
        rest = KubeRest(api_client)
        resp = rest.request("GET", f"/api/v1/namespaces/{NS}/pods/p", accept=METADATA_ONLY)
        try:
            assert resp.headers["Content-Type"] == METADATA_ONLY
            got = json.loads(resp.data)
        finally:
            resp.release_conn()
        assert set(got) == {"kind", "apiVersion", "metadata"}
        assert (got["kind"], got["apiVersion"]) == ("PartialObjectMetadata", "meta.k8s.io/v1")
        assert got["metadata"]["annotations"] == {"a": "b"}
        whole = rest.json("GET", f"/api/v1/namespaces/{NS}/pods/p")
        assert whole["spec"]["containers"][0]["env"][0]["name"] == "SECRET"
