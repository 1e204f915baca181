"""Section 11: what the agents say about the sources they cannot verify (issue 21): behind ovn0
each agent once at each start, naming it, and a Warning Event on the Service of a VM whose pod
has no port security; on per-pod veths neither."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from cozylab.cluster.rows import Case, Check, Group
from cozylab.cluster.spec import NODES, Workload, node_name

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SCENARIO = "11 source warnings"


def said_at_start(lab: ClusterLab, n: int) -> Check:
    log = lab.agents.log(n)
    said = log.count("source addresses behind ovn0 are not verified")
    starts = sum(1 for line in log.splitlines() if line.startswith("=== "))
    return said == (
        starts if lab.layout == "kubeovn" else 0
    ), f"said {said} times in {starts} starts"


def port_security_events(lab: ClusterLab, w: Workload, want: bool) -> Check:
    assert lab.api is not None
    events: list[dict[str, Any]] = [
        e
        for e in lab.api.events()
        if e["involvedObject"]["kind"] == "Service"
        and "port security" in e["message"]
        and e["involvedObject"]["name"] == w.name
    ]
    ok = bool(events) == want and all(e["type"] == "Warning" for e in events)
    return ok, "; ".join(f"{e['source'].get('host')}: {e['message']}" for e in events) or "none"


def group(lab: ClusterLab) -> Group:
    shared = lab.layout == "kubeovn"
    said = "warns at each start that ovn0 hides the sender" if shared else "no such warning"
    cases = [
        Case(SCENARIO, f"{node_name(n)}: {said}", partial(said_at_start, lab, n)) for n in NODES
    ]
    for w in lab.vms:
        want = shared and not w.port_security
        what = "a Warning Event on its Service" if want else "no port-security Event"
        case = f"{w.name} ({'no ' if not w.port_security else ''}port security): {what}"
        cases.append(Case(SCENARIO, case, partial(port_security_events, lab, w, want)))
    return Group(cases)
