"""The cluster lab of issue 18 (cozylab/cluster/): three nodes laid out as Kube-OVN lays
out a Cozystack node (natOutgoing, a vxlan overlay between the nodes' OVS namespaces) or with
per-pod veths, a real `cozyebpf run` per node against the real kube-apiserver (issue 35:
etcd, kube-apiserver and kube-controller-manager of the pinned release, one control plane for
both layouts), MetalLB-like speakers, a live migration and a Cilium-like program on ovn0 and
the tunnel.

Each layout is built once, every scenario runs against it (real sockets, real packets), it is
torn down, and each row of the result becomes one test here: a failure names the layout, the
scenario and the case, with what the far side saw."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cozylab.cluster import LAYOUTS, ClusterLab, Row, format_table, planned_cases
from cozylab.cluster.spec import API_IP
from cozylab.kubecp import ControlPlane

pytestmark = pytest.mark.requires("kube", "helm")

PLAN = {layout: planned_cases(layout) for layout in LAYOUTS}
#: the tables of the layouts that ran, for the terminal summary (tests/conftest.py): CI's log
#: shows the table of scenario x case x layout as `make cluster-lab` prints it
TABLES: dict[str, str] = {}
#: rows that show a hole not closed yet: they must fail until it is (strict)
OPEN: dict[str, str] = {}
CASES = [
    pytest.param(
        layout, s, c, marks=[pytest.mark.xfail(strict=True, reason=OPEN[s])] if s in OPEN else []
    )
    for layout in LAYOUTS
    for s, c in PLAN[layout]
]


def _id(layout: str, scenario: str, case: str) -> str:
    return f"{layout}:{scenario}:{case}".replace(" ", "_")


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """One control plane for both layouts (each lab removes what it wrote)."""
    from tests.support.env import unique_prefix

    cp = ControlPlane(unique_prefix("k"), tmp_path_factory.mktemp("control-plane"), API_IP)
    with cp:
        yield cp


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str], control_plane: ControlPlane
) -> Iterator[Callable[[str], list[Row]]]:
    """The rows of a layout: built, run and torn down at the first test that asks for it."""
    from tests.support.env import unique_prefix

    results: dict[str, list[Row]] = {}

    def rows(layout: str) -> list[Row]:
        if layout not in results:
            workdir: Path = tmp_path_factory.mktemp(f"cluster-{layout}")
            lab = ClusterLab(
                layout,
                prefix=unique_prefix("c"),
                cmd=cozyebpf_cmd,
                workdir=workdir,
                control_plane=control_plane,
            )
            with lab:
                results[layout] = lab.run_all()
            table = format_table(results[layout])
            if lab.migration:
                table += f"\nmigration: {lab.migration}"
            TABLES[layout] = f"{table}\nlogs: {workdir}"
        return results[layout]

    yield rows


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_planned_row_and_no_other(cluster: Callable[[str], list[Row]], layout: str) -> None:
    got = [(r.scenario, r.case) for r in cluster(layout)]
    assert got == PLAN[layout]


@pytest.mark.parametrize(
    "layout,scenario,case", CASES, ids=[_id(*map(str, p.values)) for p in CASES]
)
def test_scenario(
    cluster: Callable[[str], list[Row]], layout: str, scenario: str, case: str
) -> None:
    rows = {(r.scenario, r.case): r for r in cluster(layout)}
    row = rows.get((scenario, case))
    assert row is not None, f"[{layout}] no row for {scenario} / {case}"
    assert row.ok, f"[{layout}] {scenario} / {case}: {row.detail}"


#: rights of the chart's ClusterRole that the lab's agents never use but the chart keeps, each
#: with what the README says of it (the test holds the README to it): none today
KEPT: dict[str, str] = {}


def test_the_audit_log_shows_the_agents_use_every_right_and_no_other(
    cluster: Callable[[str], list[Row]], control_plane: ControlPlane
) -> None:
    """Least privilege, shown by kube-apiserver itself (issue 45, item 10): after every layout
    ran (each scenario, three agents per layout with the chart's ServiceAccount, ClusterRole and
    binding), its audit log (cozylab/kubecp/audit.py) has, for that ServiceAccount: every
    request allowed (the authorizer's decision, by the chart's ClusterRole, not the absence of
    a 403 in the agents' logs), each a resource request the ClusterRole grants; every right
    the ClusterRole grants used, or kept for what the README says (KEPT); every Pod read
    answered with a PartialObjectMetadata (what the server answered, which the audit event
    holds: the agent's Accept header asked for metadata only)."""
    from cozylab.cluster.api import chart_objects
    from cozylab.kubecp.audit import grants, requests, unused

    for layout in LAYOUTS:
        cluster(layout)
    objs = chart_objects()
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]
    binding = next(
        o
        for o in objs
        if o["kind"] == "ClusterRoleBinding"
        and {"kind": "ServiceAccount", "name": sa["name"], "namespace": sa["namespace"]}
        in o["subjects"]
    )
    role_name = binding["roleRef"]["name"]
    role = next(
        o for o in objs if o["kind"] == "ClusterRole" and o["metadata"]["name"] == role_name
    )
    user = f"system:serviceaccount:{sa['namespace']}:{sa['name']}"
    reqs = requests(control_plane.audit_log, user)
    assert reqs, f"no request of {user} in {control_plane.audit_log}"
    said = f"{len(reqs)} requests of {user} in {control_plane.audit_log}"

    refused = [str(r) for r in reqs if not r.allowed]
    assert not refused, f"{said}; not allowed: {refused[:20]}"
    by_role = f'ClusterRole "{role_name}"'
    elsewhere = [str(r) for r in reqs if by_role not in r.reason]
    assert not elsewhere, f"{said}; allowed by something else than the chart's: {elsewhere[:20]}"
    ungranted = [str(r) for r in reqs if not any(grants(rule, r) for rule in role["rules"])]
    assert not ungranted, f"{said}; not granted by a rule of {role_name}: {ungranted[:20]}"

    idle = unused(role["rules"], reqs)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert [r for r in idle if r not in KEPT] == [], f"{said}; rights never used: {idle}"
    for right, why in KEPT.items():
        assert why in readme, f"the README does not say why {role_name} keeps {right}"

    pods = [r for r in reqs if r.resource == "pods" and r.verb == "get" and r.code == 200]
    assert pods, f"{said}; no Pod read (the kubeovn layout's port security reads them)"
    answered = {r.response for r in pods}
    assert answered == {("PartialObjectMetadata", "meta.k8s.io/v1")}, f"{said}; {answered}"
    used = sorted({f"{r.verb} {r.resource} ({r.group or 'core'})" for r in reqs})
    print(f"\n{said}, all allowed by {role_name}; used: {', '.join(used)}")
