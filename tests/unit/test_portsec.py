"""Issue 21, the control plane's part: behind a pod-facing device that every pod's packets
cross (Kube-OVN's ovn0) the datapath cannot verify a pod's source address, so the agent says so
at start, and warns about each managed VM whose pod has no OVN port security (the pod
annotation ovn.kubernetes.io/port_security: "true"). cozyebpf/portsec.py."""

from __future__ import annotations

import copy
from typing import Any

from cozyebpf.model import (
    ForeignRecord,
    IncrementalModel,
    ServiceRecord,
    SliceRecord,
    read_object,
)
from tests.support.k8s import Svc, objects

Obj = dict[str, Any]


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
