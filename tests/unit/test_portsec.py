"""Issue 21, the control plane's part: behind a pod-facing device that every pod's packets
cross (Kube-OVN's ovn0) the datapath cannot verify a pod's source address, so the agent says so
at start, and warns about each managed VM whose pod has no OVN port security (the pod
annotation ovn.kubernetes.io/port_security: "true"). cozyebpf/kube/portsec.py."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cozyebpf.agent import Agent
from cozyebpf.kube.events import EventRecorder
from cozyebpf.kube.portsec import METADATA_ONLY, checks, problem_message
from cozyebpf.model import (
    ForeignRecord,
    IncrementalModel,
    ObjectRef,
    Problem,
    ServiceRecord,
    SliceRecord,
    read_object,
)
from cozyebpf.sources.kube import Backoff, KubeSource
from cozyebpf.status import agent_status
from cozylab.fakedp import FakeDatapath
from cozylab.k8s import Svc, objects
from cozylab.kubeapi import FakeKubeAPI
from tests.support.clock import FakeClock
from tests.support.labtools import wait_for

Obj = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]


def with_pods(svc: Svc, *pods: tuple[str, str]) -> list[Obj]:
    """The Service's objects, its EndpointSlice's endpoint naming `pods` as (name, nodeName)
    (one endpoint each, the same address: a live migration has two)."""
    out = copy.deepcopy(objects(svc))
    for o in out:
        if o["kind"] == "EndpointSlice":
            ep = o["endpoints"][0]
            o["endpoints"] = [
                {**ep, "nodeName": node, "targetRef": {"kind": "Pod", "name": name}}
                for name, node in pods
            ]
    return out


def record(model: IncrementalModel, objs: list[Obj]) -> None:
    for o in objs:
        rec = read_object(o, 0)
        key = (o["metadata"]["namespace"], o["metadata"]["name"])
        if isinstance(rec, ServiceRecord):
            model.set_service(key, rec)
        elif isinstance(rec, ForeignRecord):
            model.set_foreign(key, rec)
        elif isinstance(rec, SliceRecord):
            model.set_slices(key, (rec,))
    model.flush()


def test_the_model_names_a_services_ready_pods_and_keeps_them_out_of_its_state() -> None:
    vm = Svc("vm1", "203.0.113.1", "10.244.1.1", [("TCP", 22)], namespace="t1")
    plain, named = IncrementalModel(), IncrementalModel()
    objs = with_pods(vm, ("virt-launcher-vm1-a", "node1"), ("virt-launcher-vm1-b", "node2"))
    objs[1]["endpoints"].append(
        {
            "addresses": ["10.244.1.99"],
            "conditions": {"ready": False},
            "targetRef": {"kind": "Pod", "name": "not-ready"},
        }
    )
    record(named, objs)
    bare = copy.deepcopy(objs)
    for ep in bare[1]["endpoints"]:
        del ep["targetRef"]
    record(plain, bare)
    assert named.state == plain.state and named.problems() == plain.problems()
    key = ("t1", "vm1")
    assert named.backend_pods(key) == {("t1", "virt-launcher-vm1-a"), ("t1", "virt-launcher-vm1-b")}
    assert named.backend_pods(key, "node2") == {("t1", "virt-launcher-vm1-b")}
    assert plain.backend_pods(key) == frozenset()  # no targetRef
    assert named.backend_pods(("t1", "nope")) == frozenset()
    other = Svc("other", "203.0.113.2", "10.244.1.2", proxy_name="kube-proxy", namespace="t1")
    record(named, with_pods(other, ("pod-x", "node1")))
    assert named.backend_pods(("t1", "other")) == frozenset()  # not managed


# -- the agent against the API double -------------------------------------------------------------

NODE = "node1"
ANN = "ovn.kubernetes.io/port_security"
VM1 = Svc("vm1", "203.0.113.10", "10.244.1.10", [("TCP", 22)])
VM2 = Svc("vm2", "203.0.113.20", "10.244.1.20", [("TCP", 80)])
VM3 = Svc("vm3", "203.0.113.30", "10.244.1.30", [("TCP", 443)])


def pod(name: str, port_security: str | None) -> Obj:
    ann = {} if port_security is None else {ANN: port_security}
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "default", "annotations": ann}}


def put(api: FakeKubeAPI, svc: Svc, pod_name: str, node: str = NODE) -> None:
    for o in with_pods(svc, (pod_name, node)):
        api.apply(o)


def warning(service: str, pod_name: str) -> Problem:
    return Problem(
        ObjectRef("Service", "default", service),
        problem_message(("default", pod_name), ["ovn0"]),
    )


class Rig:
    """An agent on the API double with the port-security check, its reads driven by hand."""

    def __init__(self, api: FakeKubeAPI, devices: list[str], **checks_kw: Any) -> None:
        self.api = api
        self.clock = FakeClock()
        self.source = KubeSource(api.api_client(), "cozy-proxy", watch_timeout=5, request_timeout=5)
        for inf in self.source.informers:
            inf.backoff = Backoff(base=0.05, cap=0.2)
        self.unverified, ps = checks(devices, api.api_client(), NODE, **checks_kw)
        if ps is not None:
            ps.clock = self.clock
        self.portsec = ps
        self.recorder = EventRecorder(api.api_client(), NODE)
        self.reported: list[Problem] = []
        self.agent = Agent(
            self.source,
            FakeDatapath(),
            on_problems=self.on_problems,
            portsec=ps,
            unverified=self.unverified,
        )

    def on_problems(self, problems: list[Problem]) -> None:
        self.reported += problems
        self.recorder.record(problems)

    def start(self) -> None:
        self.recorder.start()
        self.source.start(self.agent.notify)
        wait_for(lambda: self.source.synced, 5, "the lists")
        self.agent.tick()

    def settle(self, what: str, until: Any) -> None:
        """Take the source's changes and read the pods that are due until `until()`."""

        def turn() -> Any:
            self.agent.tick()
            if self.portsec is not None:
                self.portsec.read_due()
            self.agent.tick()
            return until()

        wait_for(turn, 5, what)

    def pod_requests(self) -> list[str]:
        return [f"{r.method} {r.path}" for r in self.api.requests if "/pods" in r.path]

    def stop(self) -> None:
        self.source.stop()
        self.recorder.stop()


@pytest.fixture
def api() -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(bookmark_interval=0.2) as a:
        yield a


def warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and text in r.getMessage()
    ]


def test_behind_ovn0_each_vm_without_port_security_is_warned_about_until_it_has_it(
    api: FakeKubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api.apply(pod("virt-launcher-vm1-aaaaa", None))
    api.apply(pod("virt-launcher-vm2-aaaaa", "true"))
    api.apply(pod("virt-launcher-vm3-aaaaa", "false"))
    put(api, VM1, "virt-launcher-vm1-aaaaa")
    put(api, VM2, "virt-launcher-vm2-aaaaa")
    put(api, VM3, "virt-launcher-vm3-aaaaa")
    rig = Rig(api, ["ovn0"])
    assert rig.portsec is not None and rig.unverified == ["ovn0"]
    try:
        rig.start()
        want = [
            warning("vm1", "virt-launcher-vm1-aaaaa"),
            warning("vm3", "virt-launcher-vm3-aaaaa"),
        ]
        rig.settle("the warnings", lambda: rig.agent.problems() == want)
        assert rig.reported == want
        assert warnings(caplog, "has no OVN port security") == [str(p) for p in want]
        assert str(want[0]) == (
            "Service default/vm1: pod default/virt-launcher-vm1-aaaaa (its backend) has no OVN "
            "port security: behind ovn0 cozyebpf cannot verify source addresses, so this VM can "
            "send as another Service's LB IP, and a pod without port security as this one's; "
            'set the annotation ovn.kubernetes.io/port_security: "true" on the VM\'s template '
            "(KubeVirt passes it to the pod it starts next: restart or migrate the VM)"
        )
        # each pod is read with one GET of its own: no list, no watch of pods; of its metadata
        # only (PartialObjectMetadata: its spec and status never reach the agent)
        assert sorted(rig.pod_requests()) == [
            f"GET /api/v1/namespaces/default/pods/virt-launcher-vm{i}-aaaaa" for i in (1, 2, 3)
        ]
        assert {r.accept for r in api.requests if "/pods" in r.path} == {METADATA_ONLY}
        wait_for(lambda: rig.recorder.sent >= 2, 5, "the Events")
        events = {e["involvedObject"]["name"]: e for e in api.events("default")}
        assert sorted(events) == ["vm1", "vm3"]
        assert events["vm1"]["message"] == want[0].message
        status = agent_status(rig.agent)
        assert status["unverified_sources"] == ["ovn0"]
        assert [p["object"] for p in status["problems"]] == [
            "Service default/vm1",
            "Service default/vm3",
        ]
        # the same state again: nothing new is logged or reported
        rig.clock.advance(1)
        rig.settle("a quiet turn", lambda: True)
        assert len(warnings(caplog, "has no OVN port security")) == 2 and len(rig.reported) == 2

        # vm1 restarted from a template with the annotation: a new pod, a new EndpointSlice
        api.apply(pod("virt-launcher-vm1-bbbbb", "true"))
        put(api, VM1, "virt-launcher-vm1-bbbbb")
        rig.settle("vm1's warning to go", lambda: rig.agent.problems() == want[1:])
        assert "resolved: " + str(want[0]) in caplog.messages
        # vm3's pod annotated in place: read again when its Service changes (or after
        # `recheck`: the next test), not at every turn
        api.apply(pod("virt-launcher-vm3-aaaaa", "true"))
        rig.settle("a turn", lambda: True)
        assert rig.agent.problems() == want[1:]
        vm3 = Svc(VM3.name, VM3.lb_ip, VM3.pod_ip, [("TCP", 443), ("TCP", 8443)])
        put(api, vm3, "virt-launcher-vm3-aaaaa")
        rig.settle("vm3's warning to go", lambda: rig.agent.problems() == [])
        assert len(rig.reported) == 2  # nothing new reported
    finally:
        rig.stop()


def test_per_pod_devices_warn_about_nothing_and_read_no_pod(
    api: FakeKubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    api.apply(pod("virt-launcher-vm1-aaaaa", None))
    put(api, VM1, "virt-launcher-vm1-aaaaa")
    rig = Rig(api, ["lxc*", "cali?"])
    assert rig.portsec is None and rig.unverified == []
    try:
        rig.start()
        rig.settle("vm1 programmed", lambda: rig.agent.model.views() != [])
        assert rig.agent.problems() == [] and rig.pod_requests() == []
        assert agent_status(rig.agent)["unverified_sources"] == []
        assert warnings(caplog, "") == []
    finally:
        rig.stop()


def test_the_start_warning_names_the_shared_devices_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    shared, ps = checks(["ovn0", "lxc*"], None, NODE)  # --manifests: no API, no pod reads
    assert shared == ["ovn0"] and ps is None
    assert warnings(caplog, "") == [
        "source addresses behind ovn0 are not verified: every pod's packets enter the node "
        "through it, so cozyebpf cannot tell which pod sent one; only the CNI can (Kube-OVN: "
        'port security, the pod annotation ovn.kubernetes.io/port_security: "true")'
    ]


def test_without_get_pods_one_warning_names_the_permission_and_nothing_breaks(
    api: FakeKubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    for svc in (VM1, VM2):
        api.apply(pod(f"virt-launcher-{svc.name}-aaaaa", None))
        put(api, svc, f"virt-launcher-{svc.name}-aaaaa")
    api.forbid("pods")
    rig = Rig(api, ["ovn0"], cluster_role="cozy-proxy")  # the chart's fullnameOverride
    assert rig.portsec is not None
    try:
        rig.start()
        rig.settle("a refused read", lambda: rig.pod_requests() != [])
        for _ in range(3):  # resyncs, rechecks: still one warning, one refused read a round
            rig.clock.advance(rig.portsec.recheck)
            rig.settle("a turn", lambda: True)
        assert len(rig.pod_requests()) == 4
        (line,) = warnings(caplog, "403")
        assert line == (
            "cannot read pod default/virt-launcher-vm1-aaaaa (HTTP 403 Forbidden): the "
            "ClusterRole cozy-proxy lacks `get pods`, so whether the VMs behind ovn0 have OVN port "
            'security is not checked; add the rule {apiGroups: [""], resources: ["pods"], '
            'verbs: ["get"]} to it (the Helm chart and deploy/rbac.yaml have it)'
        )
        assert rig.agent.problems() == [] and len(rig.agent.model.views()) == 2
        api.forbid("pods", False)  # the ClusterRole fixed
        rig.clock.advance(rig.portsec.recheck)
        want = [
            warning("vm1", "virt-launcher-vm1-aaaaa"),
            warning("vm2", "virt-launcher-vm2-aaaaa"),
        ]
        rig.settle("the warnings", lambda: rig.agent.problems() == want)
        # vm2's pod annotated in place: read again `recheck` after the last read, not before
        api.apply(pod("virt-launcher-vm2-aaaaa", "true"))
        rig.clock.advance(rig.portsec.recheck - 1)
        rig.settle("a turn", lambda: True)
        assert rig.agent.problems() == want
        rig.clock.advance(1)
        rig.settle("vm2's warning to go", lambda: rig.agent.problems() == want[:1])
    finally:
        rig.stop()


def test_a_missing_pod_is_named_once_and_pods_of_other_nodes_are_not_read(
    api: FakeKubeAPI, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    put(api, VM1, "virt-launcher-vm1-gone")
    api.apply(pod("virt-launcher-vm2-aaaaa", None))
    put(api, VM2, "virt-launcher-vm2-aaaaa", node="node2")  # another node's agent checks it
    rig = Rig(api, ["ovn0"])
    assert rig.portsec is not None
    try:
        rig.start()
        rig.settle("the read", lambda: rig.pod_requests() != [])
        for _ in range(3):
            rig.clock.advance(rig.portsec.recheck)
            rig.settle("a turn", lambda: True)
        assert rig.pod_requests() == ["GET /api/v1/namespaces/default/pods/virt-launcher-vm1-gone"]
        assert warnings(caplog, "not found") == [
            "pod default/virt-launcher-vm1-gone, named by the EndpointSlice of Service "
            "default/vm1, was not found (HTTP 404), so its port security is not checked"
        ]
        assert rig.agent.problems() == []
        # read again when its Service or EndpointSlice changes (here a port of the Service);
        # still not there: not named again
        vm1 = Svc(VM1.name, VM1.lb_ip, VM1.pod_ip, [("TCP", 22), ("TCP", 2)])
        put(api, vm1, "virt-launcher-vm1-gone")
        rig.settle("the read", lambda: len(rig.pod_requests()) == 2)
        assert len(warnings(caplog, "not found")) == 1
        api.apply(pod("virt-launcher-vm1-gone", None))
        vm1 = Svc(VM1.name, VM1.lb_ip, VM1.pod_ip, [("TCP", 22), ("TCP", 2222)])
        put(api, vm1, "virt-launcher-vm1-gone")
        rig.settle(
            "the warning",
            lambda: rig.agent.problems() == [warning("vm1", "virt-launcher-vm1-gone")],
        )
    finally:
        rig.stop()


def test_the_shipped_clusterrole_is_the_one_the_403_warning_names() -> None:
    import yaml

    from cozyebpf.kube.portsec import CLUSTER_ROLE

    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()) if d]
    # the agent's own (the other one grants reading the metrics)
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["subjects"][0]["name"] == "cozyebpf"
    ]
    assert binding["roleRef"]["name"] == CLUSTER_ROLE
    (role,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == CLUSTER_ROLE
    ]
    pods = [r for r in role["rules"] if "pods" in r["resources"]]
    assert pods == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
