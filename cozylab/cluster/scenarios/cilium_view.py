"""Section 9: what the Cilium-like observer (cozylab/cilium.py) saw on each node: not one
packet to an LB IP, since cozyebpf translates them before it (on ovn0 and the tunnel, kubeovn;
on eth0, perpod)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from cozylab.cluster.rows import Case, Check, Group
from cozylab.cluster.spec import NODES, node_name

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SCENARIO = "9 cilium view"


def nothing_to_an_lb(lab: ClusterLab, n: int) -> Check:
    assert lab.observer is not None
    counts = [c for c in lab.observer.counts() if c.point.node == n]
    devs = " + ".join(sorted({c.point.dev for c in counts}))
    detail = "; ".join(
        f"{c.point.name}: to LB {c.to_lb}, from LB {c.from_lb}, dropped {c.dropped}" for c in counts
    )
    ok = bool(counts) and devs == lab.observed_devices() and sum(c.to_lb for c in counts) == 0
    return ok, f"mode {lab.observer_mode}; {detail}"


def group(lab: ClusterLab) -> Group:
    cases = [
        Case(
            SCENARIO,
            f"{node_name(n)} {lab.observed_devices()}: no packet to an LB IP",
            partial(nothing_to_an_lb, lab, n),
        )
        for n in NODES
    ]
    return Group(cases)
