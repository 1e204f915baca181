"""An LB IP never takes an address already in use (issue 31): this node's addresses, every
Node's, IPv4 link-local, a managed pod's IP and the operator's --reserved-cidrs. A Service that
asks for one is refused whole (no entry of either family), with an error that names the address,
what it already is and the fix; every other Service is unaffected; and a legitimate LB IP is
never refused. The incremental model follows addresses that come and go
(tests/unit/test_incremental.py holds it to build_state on random histories)."""

from __future__ import annotations

from ipaddress import ip_address, ip_network
from typing import Any

import pytest

from cozyebpf.model import (
    IncrementalModel,
    ModelResult,
    NodeRecord,
    ObjectRef,
    Refusal,
    build_state,
    read_object,
    read_objects,
)
from cozyebpf.state import IPAddress
from tests.unit.test_model import LB1, LB2, POD1, POD2, T_NEW, T_OLD, endpoints, service

Obj = dict[str, Any]
NODE_IP, OTHER_NODE_IP = "192.0.2.1", "192.0.2.2"
LB6, POD6 = "2001:db8::10", "fd00:10:244::5"


def node(name: str, *addresses: tuple[str, str]) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name},
        "status": {"addresses": [{"type": t, "address": a} for t, a in addresses]},
    }


def vm(name: str, lb: str | tuple[str, ...], pod: str, created: str = T_OLD) -> list[Obj]:
    """A whole-IP Service with its one ready pod."""
    ips = (lb,) if isinstance(lb, str) else lb
    return [
        service(name, ips=ips, whole_ip="true", created=created),
        endpoints(name, "default", pod),
    ]


def refusals(result: ModelResult, name: str) -> tuple[Refusal, ...]:
    (view,) = [v for v in result.services if v.ref.name == name]
    return view.refused


def refused_messages(result: ModelResult, name: str) -> list[str]:
    """The messages of `name`'s refusal Problems (a warning: a Warning log line and Event)."""
    return [
        p.message
        for p in result.problems
        if p.ref.name == name
        and p.message.startswith("is not programmed: its LoadBalancer IP")
        and p.severity == "warning"
    ]


def ip(text: str) -> IPAddress:
    return ip_address(text)


def test_a_legitimate_lb_ip_is_programmed() -> None:
    """Nothing refused when the LB IP is no node's, pod's, link-local or reserved address."""
    r = build_state(
        [*vm("vm1", LB1, POD1), node("n1", ("InternalIP", NODE_IP))],
        local={ip(NODE_IP): "eth0"},
        reserved_cidrs=[ip_network("10.96.0.0/12")],
    )
    assert ip(LB1) in r.state.services
    assert refusals(r, "vm1") == ()
    assert not r.problems


@pytest.mark.parametrize(
    ("lb", "kind", "what"),
    [
        (NODE_IP, "node-address", "this node's address on eth0"),
        (OTHER_NODE_IP, "node", "node n2's InternalIP"),
        ("203.0.113.50", "node", "node n2's ExternalIP"),
        ("169.254.1.1", "link-local", "an IPv4 link-local address (169.254.0.0/16)"),
        ("169.254.169.254", "link-local", "an IPv4 link-local address (169.254.0.0/16)"),
        ("10.96.0.1", "reserved-cidr", "in the reserved range 10.96.0.0/12 (--reserved-cidrs)"),
        (POD2, "pod", "the pod IP of the backend of Service default/vm2"),
    ],
)
def test_a_service_that_claims_an_address_in_use_is_refused_whole(
    lb: str, kind: str, what: str
) -> None:
    objects = [
        *vm("vm1", lb, POD1),
        *vm("vm2", LB2, POD2),
        node("n1", ("InternalIP", NODE_IP), ("Hostname", "n1")),
        node("n2", ("InternalIP", OTHER_NODE_IP), ("ExternalIP", "203.0.113.50")),
    ]
    r = build_state(
        objects, local={ip(NODE_IP): "eth0"}, reserved_cidrs=[ip_network("10.96.0.0/12")]
    )
    assert refusals(r, "vm1") == (Refusal(ip(lb), kind, what),)
    # not programmed at all: neither its LB IP nor its pod's egress
    assert [e.service for e in r.state.services.values()] == ["default/vm2"]
    assert ip(POD1) not in r.state.pods
    (msg,) = refused_messages(r, "vm1")
    assert msg.startswith(f"is not programmed: its LoadBalancer IP {lb} is {what}")
    assert "give the Service an address of its own" in msg
    # every other Service as it was
    assert r.state.services[ip(LB2)].pod_ip == ip(POD2)
    assert r.state.pods[ip(POD2)].lb_ip == ip(LB2)
    assert refusals(r, "vm2") == ()
    assert not refused_messages(r, "vm2")
    view = next(v for v in r.services if v.ref.name == "vm1")
    assert not view.programmed_lb_ips and "REFUSED" in str(view)


def test_one_reserved_lb_ip_refuses_both_families() -> None:
    """A dual-stack Service whose IPv4 LB IP is the node's: its IPv6 LB IP is not programmed
    either (a Service is refused whole, never half)."""
    objects = [
        service("vm1", ips=(NODE_IP, LB6), whole_ip="true"),
        endpoints("vm1", "default", POD1),
        endpoints("vm1", "default", POD6, name="vm1-v6", address_type="IPv6"),
    ]
    r = build_state(objects, local={ip(NODE_IP): "eth0"})
    assert r.state.services == {} and r.state.pods == {}
    assert [x.lb for x in refusals(r, "vm1")] == [ip(NODE_IP)]
    without = build_state(objects)
    assert set(without.state.services) == {ip(NODE_IP), ip(LB6)}


def test_ipv6_node_address_is_refused() -> None:
    r = build_state([*vm("vm1", LB6, POD6)], local={ip(LB6): "br0"})
    assert refusals(r, "vm1") == (Refusal(ip(LB6), "node-address", "this node's address on br0"),)
    assert not r.state.services


def test_an_older_service_keeps_its_claim_while_refused() -> None:
    """The older Service is refused (one LB IP is the node's); its other LB IP still belongs to
    it, so a younger Service that also claims it is told so and does not take it over."""
    objects = [
        *vm("old", (NODE_IP, LB1), POD1, created=T_OLD),
        *vm("new", LB1, POD2, created=T_NEW),
    ]
    r = build_state(objects, local={ip(NODE_IP): "eth0"})
    assert r.state.services == {}
    assert any("also claimed by the older Service default/old" in m for m in messages(r, "new"))


def messages(r: ModelResult, name: str) -> list[str]:
    return [p.message for p in r.problems if p.ref.name == name]


def test_a_node_object_is_read_into_its_ip_addresses() -> None:
    rec = read_object(
        node(
            "n1",
            ("InternalIP", "192.0.2.1"),
            ("InternalIP", "2001:db8::1"),
            ("Hostname", "n1.example"),
            ("InternalDNS", "n1.cluster.local"),
            ("ExternalIP", "not an address"),
        ),
        1,
    )
    assert rec == NodeRecord(
        ObjectRef("Node", "", "n1"),
        ((ip("192.0.2.1"), "InternalIP"), (ip("2001:db8::1"), "InternalIP")),
    )
    assert read_objects([node("n1", ("InternalIP", "192.0.2.1"))]).nodes == {
        ("", "n1"): NodeRecord(ObjectRef("Node", "", "n1"), ((ip("192.0.2.1"), "InternalIP"),))
    }
    # a Node with no status, or garbage in it, is read as one without addresses
    assert read_object({"kind": "Node", "metadata": {"name": "n2"}, "status": 7}, 1) == (
        NodeRecord(ObjectRef("Node", "", "n2"), ())
    )


def test_an_address_added_later_takes_precedence() -> None:
    """A Service programmed with an LB IP that the node then takes as its own: its entries go
    and it is refused; when the address goes, it is programmed again. The same with a Node."""
    m = IncrementalModel()
    m.replace(read_objects([*vm("vm1", LB1, POD1), *vm("vm2", LB2, POD2)]))
    m.flush()
    assert ip(LB1) in m.state.services

    assert m.set_local({ip(LB1): "eth0", ip(NODE_IP): "eth0"})
    d = m.flush()
    assert d.diff.services_del == {ip(LB1)} and d.diff.pods_del == {ip(POD1)}
    assert not d.diff.services_set and not d.diff.pods_set  # vm2 untouched
    assert [p.message.split(":")[0] for p in d.problems_added] == ["is not programmed"]
    assert d.recomputed == 1

    assert not m.set_local({ip(LB1): "eth0", ip(NODE_IP): "eth0"})  # no change, no work
    assert m.set_local({ip(NODE_IP): "eth0"})
    d = m.flush()
    assert set(d.diff.services_set) == {ip(LB1)} and d.problems_removed

    assert m.set_node(
        ("", "n2"), NodeRecord(ObjectRef("Node", "", "n2"), ((ip(LB2), "InternalIP"),))
    )
    d = m.flush()
    assert d.diff.services_del == {ip(LB2)}
    assert "node n2's InternalIP" in d.problems_added[0].message
    assert m.set_node(("", "n2"), None)
    d = m.flush()
    assert set(d.diff.services_set) == {ip(LB2)}


def test_a_pod_that_comes_to_hold_an_lb_ip_refuses_that_service() -> None:
    """vm1's LB IP becomes vm2's pod IP (vm2's endpoint changes): vm1 is refused; when the pod
    goes, vm1 is programmed again."""
    m = IncrementalModel()
    objs = [*vm("vm1", "10.244.9.9", POD1), *vm("vm2", LB2, POD2)]
    m.replace(read_objects(objs))
    m.flush()
    assert ip("10.244.9.9") in m.state.services
    objs[3] = endpoints("vm2", "default", "10.244.9.9")
    m.replace(read_objects(objs))
    m.flush()
    assert ip("10.244.9.9") not in m.state.services
    assert m.state.pods[ip("10.244.9.9")].lb_ip == ip(LB2)  # vm2 works
    objs[3] = endpoints("vm2", "default", POD2)
    m.replace(read_objects(objs))
    m.flush()
    assert m.state.services[ip("10.244.9.9")].pod_ip == ip(POD1)
