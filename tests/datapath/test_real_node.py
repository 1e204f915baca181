"""The real-node lab (issue 44, cozylab/realnode/): the chart installed with the real helm on two
nodes that are real (each its own containerd, kubelet and kube-proxy), backends that are real
Pods whose readiness the kubelets' probes decide, and the user's lifecycle with the real tools:
helm install, kubectl exec and logs, a killed agent, a rescheduled backend, a failing probe,
helm uninstall, and helm upgrade and rollback from the previous release (its release commit's
chart and image) and between two builds of main, under traffic.

The story runs once (`make real-node-lab` runs the same and prints its table); each step is a
test here, failing with the rows of that step that failed. About 10 minutes on this machine
with the images built (scripts/setup.sh --real-node builds them; README, "The real-node lab")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cozylab.realnode.__main__ import format_rows, run
from cozylab.realnode.story import STEPS, Row

pytestmark = pytest.mark.requires("real-node", "helm")


@pytest.fixture(scope="module")
def rows(
    tmp_path_factory: pytest.TempPathFactory, alone_with_qemu_and_the_nodes: None
) -> Iterator[list[Row]]:
    from tests.support.env import unique_prefix

    workdir: Path = tmp_path_factory.mktemp("real-node")
    out = run(workdir, prefix=unique_prefix("rn"))
    print("\n" + format_rows(out))
    yield out


@pytest.mark.parametrize("step", [*STEPS, "nothing left"])
def test_step(rows: list[Row], step: str) -> None:
    mine = [r for r in rows if r.step == step or r.step.startswith(f"{step}:")]
    assert mine, f"the step {step!r} made no row (the story stopped before it?)"
    failed = [r for r in mine if not r.ok]
    assert not failed, "\n".join(f"{r.check}: {r.detail}" for r in failed)
