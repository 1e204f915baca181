"""The cluster lab on Kube-OVN's real dataplane (cozylab/realovn/, issue 27): Open vSwitch and
OVN themselves, three chassis with geneve between them through OVS's userspace datapath,
Kube-OVN's logical topology and node side, one `cozyebpf run` per node.

Every row of the model lab's kubeovn layout (tests/datapath/test_cluster_lab.py) runs here on
the real dataplane, plus OVN's port security (MAC and ARP) and rows only a real dataplane has
(a VM reached across chassis by geneve, natOutgoing, the geneve MTU); each row is one test.
The lab is built once for the module (about 70 s here, most of it the agents' start) and torn
down; the last tests check that no daemon, namespace or file is left, also after a bring-up
that fails half-way and after a run killed before its teardown."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cozylab.cluster import Row, format_table
from cozylab.realovn import Ovn, RealOvnLab, planned_cases

pytestmark = pytest.mark.requires("ovn", "kube", "helm")

PLAN = planned_cases()
#: the table of the run, for the terminal summary (tests/conftest.py)
TABLES: dict[str, str] = {}


def _daemons_under(root: Path) -> list[str]:
    """Processes whose command line names `root` (the lab's daemons), as "pid cmdline"."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(root) in cmd and state != "Z":
            out.append(f"{proc.name} {cmd}")
    return out


def _namespaces(prefix: str) -> list[str]:
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    return [n for n in names if n.startswith(f"{prefix}-")]


@pytest.fixture(scope="module")
def real_ovn(
    tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]
) -> Iterator[Callable[[], list[Row]]]:
    """The rows: the lab built, run and torn down at the first test that asks for them."""
    from tests.support.env import unique_prefix

    results: list[Row] = []
    prefix = unique_prefix("o")

    def rows() -> list[Row]:
        if not results:
            workdir = tmp_path_factory.mktemp("real-ovn")
            lab = RealOvnLab(prefix=prefix, cmd=cozyebpf_cmd, workdir=workdir)
            with lab:
                results.extend(lab.run_all())
            # teardown: every daemon stopped, every namespace and the run directory gone
            leftovers = _daemons_under(lab.ovn.root) + _namespaces(prefix)
            leftovers += [str(lab.ovn.root)] if lab.ovn.root.exists() else []
            results.append(
                Row("teardown", "nothing left", "real-ovn", not leftovers, f"{leftovers}")
            )
            TABLES["real-ovn"] = (
                f"{format_table(results)}\nmigration: {lab.migration}\n"
                f"bindings: {lab.bindings}\nlogs: {workdir}"
            )
        return results

    yield rows


def test_every_planned_row_and_no_other(real_ovn: Callable[[], list[Row]]) -> None:
    got = [(r.scenario, r.case) for r in real_ovn() if r.scenario != "teardown"]
    assert got == PLAN


@pytest.mark.parametrize("scenario,case", PLAN, ids=[f"{s}:{c}".replace(" ", "_") for s, c in PLAN])
def test_row(real_ovn: Callable[[], list[Row]], scenario: str, case: str) -> None:
    rows = {(r.scenario, r.case): r for r in real_ovn()}
    row = rows.get((scenario, case))
    assert row is not None, f"no row for {scenario} / {case}"
    assert row.ok, f"{scenario} / {case}: {row.detail}"


def test_teardown_leaves_nothing(real_ovn: Callable[[], list[Row]]) -> None:
    row = next(r for r in real_ovn() if r.scenario == "teardown")
    assert row.ok, f"left behind: {row.detail}"


class _FailsHalfway(RealOvnLab):
    """Fails after node1's chassis and ovn0 are up, before any agent."""

    def _ovs(self, n: int) -> None:
        super()._ovs(n)
        if n == 2:
            raise RuntimeError("injected failure")


def test_a_failed_bring_up_leaves_nothing(tmp_path: Path, cozyebpf_cmd: list[str]) -> None:
    from tests.support.env import unique_prefix

    prefix = unique_prefix("of")
    lab = _FailsHalfway(prefix=prefix, cmd=cozyebpf_cmd, workdir=tmp_path)
    started: list[str] = []
    real_start = lab.ovn.start

    def start(*a: object, **kw: str) -> object:
        d = real_start(*a, **kw)  # type: ignore[arg-type]
        started.append(f"{d.name}:{d.proc.pid}")
        return d

    lab.ovn.start = start  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError, match="injected failure"):
        lab.up()
    assert len(started) == 3 + 3 * 3, started  # central + three chassis were running
    assert _daemons_under(lab.ovn.root) == []
    assert _namespaces(prefix) == []
    assert not lab.ovn.root.exists()


def test_leftovers_of_a_killed_run_are_stopped(tmp_path: Path) -> None:
    """Daemons a run left (killed before its teardown) are stopped by the next run with the
    same prefix, by the pids in their pidfiles."""
    from tests.support.env import unique_prefix

    root = Path("/tmp") / f"{unique_prefix('ol')}-ovn"
    left = Ovn(root, lambda ns: ["nsenter", f"--net=/run/netns/{ns}"])
    try:
        left.start_central()
        pids = [d.proc.pid for d in left.daemons]
        assert len(_daemons_under(root)) == 3
        stopped = Ovn.stop_leftovers(root)
        for d in left.daemons:  # reap them (a killed run's would be reaped by init)
            d.proc.wait(timeout=5)
        assert sorted(int(s.split(":")[1]) for s in stopped) == sorted(pids)
        assert _daemons_under(root) == []
        assert not root.exists()
    finally:
        left.stop()
