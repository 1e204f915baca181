"""Live migration in the model: a pod ready on two nodes, or moved a moment ago, is learning
(CZ_F_LEARN: TCP that opens nothing passes its filter, docs/design.md "Live migration"). The
datapath's side is in tests/test_differential.py (pass_learn) and the cluster lab (section 7)."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

from cozyebpf.datapath.codec import flags_of, pod_entry, service_entry
from cozyebpf.datapath.layout import F_ALLOW_ICMP, F_LEARN, F_PORT_FILTER
from cozyebpf.model import (
    DEFAULT_PROXY_NAME,
    LABEL_PROXY_NAME,
    LABEL_SERVICE_NAME,
    MIGRATION_HOLD,
    IncrementalModel,
    SliceRecord,
    build_state,
    read_object,
    read_objects,
)

LB, POD = ip_address("203.0.113.10"), ip_address("10.244.1.10")


def service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "namespace": "tenant",
            "name": "vm",
            "labels": {LABEL_PROXY_NAME: DEFAULT_PROXY_NAME},
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"type": "LoadBalancer", "ports": [{"port": 22, "protocol": "TCP"}]},
        "status": {"loadBalancer": {"ingress": [{"ip": str(LB)}]}},
    }


def endpoints(*nodes: str) -> dict[str, Any]:
    """The virt-launcher pods of one VM: one address, a node each."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"namespace": "tenant", "name": "vm-x", "labels": {LABEL_SERVICE_NAME: "vm"}},
        "addressType": "IPv4",
        "endpoints": [
            {"addresses": [str(POD)], "conditions": {"ready": True}, "nodeName": n} for n in nodes
        ],
    }


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def feed(model: IncrementalModel, *nodes: str) -> None:
    model.replace(read_objects([service(), endpoints(*nodes)]))
    model.flush()


def learning(model: IncrementalModel) -> tuple[bool, bool]:
    """(the LB IP's entry, the pod's entry) learning."""
    st = model.state
    return st.services[LB].learning, st.pods[POD].learning


def test_a_slice_record_pairs_ready_addresses_with_their_nodes() -> None:
    rec = read_object(endpoints("node1", "node3"), 1)
    assert isinstance(rec, SliceRecord)
    assert rec.ready == (POD,)
    assert list(rec.node_pairs()) == [(POD, "node1"), (POD, "node3")]
    assert rec.nodes == (POD, "node1", POD, "node3")  # flat: one tuple for the slice


def test_a_pod_on_one_node_is_not_learning() -> None:
    model = IncrementalModel(clock=Clock())
    feed(model, "node1")
    assert learning(model) == (False, False)
    assert model.held == frozenset()
    assert model.next_deadline() is None


def test_both_ready_is_one_backend_that_learns_without_a_problem() -> None:
    res = build_state([service(), endpoints("node1", "node3")])
    assert res.state.services[LB].pod_ip == POD
    assert res.state.services[LB].learning and res.state.pods[POD].learning
    assert res.problems == []
    assert res.services[0].migrating == (POD,)
    assert "migrating 10.244.1.10" in str(res.services[0])


def test_learning_lasts_the_hold_after_the_move_then_ends() -> None:
    clock = Clock()
    model = IncrementalModel(clock=clock)
    feed(model, "node1")
    feed(model, "node1", "node3")  # both ready
    assert learning(model) == (True, True)
    feed(model, "node3")  # new ready: the flows are still on node1
    assert learning(model) == (True, True)
    assert model.next_deadline() == clock.now + MIGRATION_HOLD
    clock.now += MIGRATION_HOLD - 1
    assert not model.pending
    clock.now += 1
    assert model.pending  # the agent's next tick flushes
    d = model.flush()
    assert learning(model) == (False, False)
    assert model.held == frozenset()
    assert set(d.diff.services_set) == {LB} and set(d.diff.pods_set) == {POD}


def test_a_move_in_one_step_learns_too() -> None:
    """old ready -> new ready with no "both ready" between them (another order of updates)."""
    clock = Clock()
    model = IncrementalModel(clock=clock)
    feed(model, "node1")
    feed(model, "node2")
    assert learning(model) == (True, True)
    clock.now += MIGRATION_HOLD
    model.flush()
    assert learning(model) == (False, False)


def test_a_long_memory_copy_keeps_learning_while_both_are_ready() -> None:
    clock = Clock()
    model = IncrementalModel(clock=clock)
    feed(model, "node1", "node3")  # seen first as both ready (an agent that just started)
    for _ in range(5):
        clock.now += MIGRATION_HOLD
        assert model.pending
        model.flush()
        assert learning(model) == (True, True)
    feed(model, "node3")
    clock.now += MIGRATION_HOLD
    model.flush()
    assert learning(model) == (False, False)


def test_endpoints_without_a_node_never_learn() -> None:
    """A manifest's slices often name no node: no move can be seen, nothing learns."""
    slice_obj = endpoints("node1")
    del slice_obj["endpoints"][0]["nodeName"]
    res = build_state([service(), slice_obj])
    assert not res.state.services[LB].learning


def test_the_learning_bit_is_encoded_and_decoded_with_the_filter_bits() -> None:
    e = service_entry(POD.packed, F_PORT_FILTER | F_LEARN, "tenant/vm")
    assert (e.port_filter, e.allow_icmp, e.learning) == (True, False, True)
    assert flags_of(e) == F_PORT_FILTER | F_LEARN
    p = pod_entry(LB.packed, F_PORT_FILTER | F_ALLOW_ICMP)
    assert (p.port_filter, p.allow_icmp, p.learning) == (True, True, False)
    assert flags_of(p) == F_PORT_FILTER | F_ALLOW_ICMP
