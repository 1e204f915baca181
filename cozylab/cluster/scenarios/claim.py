"""Section 12: a whole-IP Service whose LB IP is a node's address (a pool that overlaps the
nodes' network, a typo; issue 31): every agent refuses it, a Warning Event names the address,
and the nodes' own traffic to that address (the kubelet's port) still reaches the node."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from cozylab.cluster.api import VM_LABEL, PodState, pod_object
from cozylab.cluster.rows import Case, Check, Group
from cozylab.cluster.spec import CLIENT_IP, NODE_PORT, NODES, Workload, node_ip, node_name
from cozylab.netns import wait_for

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SCENARIO = "12 reserved addresses"
#: the node whose address the Service asks for, and its backend
CLAIMED_NODE, CLAIM_BACKEND = 2, "p1"
CLAIMED = node_ip(CLAIMED_NODE)


def refused(lab: ClusterLab) -> Check:
    """No agent programmed the claimed address and each said why."""
    bad, said = [], []
    for n, a in lab.agents.by_node.items():
        what = (
            "this node's address on eth0"
            if n == CLAIMED_NODE
            else f"node {node_name(CLAIMED_NODE)}'s InternalIP"
        )
        line = f"its LoadBalancer IP {CLAIMED} is {what}"
        if CLAIMED in lab.agents.lb_map(a) or line not in lab.agents.log(n):
            bad.append(node_name(n))
        else:
            said.append(f"{node_name(n)}: {what}")
    return not bad, "; ".join(said) + (f"; programmed or silent on {bad}" if bad else "")


def event(lab: ClusterLab) -> Check:
    api = lab.api
    assert api is not None

    def posted() -> list[dict[str, Any]]:  # Events are posted in the background
        return [
            e
            for e in api.events()
            if e["involvedObject"]["name"] == "vm-claim" and CLAIMED in e["message"]
        ]

    with contextlib.suppress(TimeoutError):
        wait_for(posted, 10, "an Event on vm-claim")
    got = posted()
    ok = bool(got) and all(e["type"] == "Warning" for e in got)
    return ok, "; ".join(f"{e['source'].get('host')}: {e['reason']}" for e in got)


@contextlib.contextmanager
def claimed(lab: ClusterLab) -> Iterator[None]:
    """The claiming Service and its backend pod (the EndpointSlice controller writes the
    slice) while the rows run, every agent synced."""
    api = lab.api
    assert api is not None
    backend = lab.workloads[CLAIM_BACKEND]
    claim = Workload("vm-claim", 98, backend.node, backend.ip, CLAIMED, True)
    node = lab.location[CLAIM_BACKEND]
    try:
        api.put_service(claim)
        pod = pod_object(CLAIM_BACKEND, {VM_LABEL: claim.name}, node)
        api.put_pod(pod, PodState(claim.name, node, backend.ip))
        lab.sync_agents()
        yield
    finally:
        api.delete_service(claim.name)
        api.delete_pod(CLAIM_BACKEND)


def group(lab: ClusterLab) -> Group:
    s, claimed_node = SCENARIO, node_name(CLAIMED_NODE)
    cases = [
        Case(
            s,
            f"vm-claim asks for {claimed_node}'s address: refused by every agent",
            partial(refused, lab),
        ),
        Case(s, "a Warning Event on vm-claim names the address", partial(event, lab)),
    ]
    for n in NODES:
        if n != CLAIMED_NODE:
            check = partial(lab.check, "tcp", lab.node(n), CLAIMED, NODE_PORT, node_ip(n))
            case = f"{node_name(n)} -> {claimed_node}'s address tcp/{NODE_PORT}: the node answers"
            cases.append(Case(s, case, check))
    check = partial(lab.check, "tcp", lab.client, CLAIMED, NODE_PORT, CLIENT_IP)
    cases.append(
        Case(s, f"client -> {claimed_node}'s address tcp/{NODE_PORT}: the node answers", check)
    )
    return Group(cases, around=partial(claimed, lab))
