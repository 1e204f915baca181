"""Shared fixtures, and what each test needs from the machine (tests/support/prereqs.py).

Tests under tests/datapath get the marker `datapath` (root, bcc, kernel headers, bpffs, the
lab's commands); `requires(...)` names further prerequisites, and some fixtures need their own
(`helm`). They are checked at collection:
outside CI a test whose prerequisites are missing is skipped with the reason before any of its
fixtures runs; under CI=true it FAILS, so a CI run can never pass without exercising the
datapath. One exception: a test that needs what this kernel was built without (fq) and that the
kernel matrix's CI guest runs (prereqs.IN_GUEST) is skipped here, and test_kernel_guest fails
unless it passed in the guest."""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import prereqs
from tests.support.env import IN_CI, TEST_CMD

DATAPATH_DIR = Path(__file__).resolve().parent / "datapath"
#: The packet tests (marker `packet`; named here and nowhere else): the real programs loaded
#: and scapy-built frames sent through veths of namespace labs or BPF_PROG_RUN, compared whole:
#: NAT both ways, the port filter, ICMP, IPv6, PMTU (ICMP fragmentation-needed to the pod) and
#: fragments. What the Vagrant VM's `test` provisioner runs (`pytest -m packet`, vagrant/).
PACKET_TESTS = ("test_lab.py", "test_dualstack.py", "test_pmtu.py", "test_prog_run.py")
_MISSING = pytest.StashKey[str]()


def needs(item: pytest.Item) -> list[str]:
    """The prerequisites `item` needs, by its markers."""
    names: list[str] = []
    if item.get_closest_marker("datapath") is not None:
        names += prereqs.DATAPATH
    for mark in item.iter_markers("requires"):
        names += mark.args
    for fixture in getattr(item, "fixturenames", ()):
        names += prereqs.FIXTURES.get(fixture, ())
    return names


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        prereqs.forced()
        for item in items:
            if DATAPATH_DIR in item.path.resolve().parents:
                item.add_marker(pytest.mark.datapath)
                if item.path.name in PACKET_TESTS:
                    item.add_marker(pytest.mark.packet)
            missing = prereqs.missing_of(needs(item))
            if not missing:
                continue
            reason = "missing: " + "; ".join(missing)
            lacking = [n for n in needs(item) if prereqs.missing(n)]
            if prereqs.runs_in_guest(item.path, lacking):
                reason += "; the kernel matrix's CI guest runs it (test_kernel_guest)"
                item.add_marker(pytest.mark.skip(reason=reason))
            elif IN_CI:
                item.stash[_MISSING] = reason
            else:
                item.add_marker(pytest.mark.skip(reason=reason))
    except ValueError as e:  # an unknown name in a marker or COZYEBPF_TEST_MISSING
        raise pytest.UsageError(str(e)) from None
    # the Vagrant VM (about 20 minutes under emulation): CI runs it; a local run may leave it
    # out with COZYEBPF_VM_LAB=0, which CI=true ignores
    if os.environ.get("COZYEBPF_VM_LAB") == "0" and not IN_CI:
        vm = [i for i in items if i.get_closest_marker("vm_lab") is not None]
        if vm:
            config.hook.pytest_deselected(items=vm)
            items[:] = [i for i in items if i.get_closest_marker("vm_lab") is None]
    items.sort(key=_slow_first)  # stable: a module's tests keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under CI=true a test with a missing prerequisite fails here, before its fixtures."""
    reason = item.stash.get(_MISSING, None)
    if reason is not None:
        pytest.fail(f"{reason} (CI=true: these tests must run, not skip)", pytrace=False)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def cozyebpf_cmd(repo_root: Path) -> list[str]:
    """The cozyebpf command: COZYEBPF_TEST_CMD, else the repository's venv. Every test that
    runs cozyebpf (agent, `maps dump`, `detach`, the demo's) takes it from here."""
    if TEST_CMD:
        return TEST_CMD
    venv = repo_root / ".venv" / "bin" / "python"
    python = str(venv) if venv.exists() else shutil.which("python3") or "python3"
    return [python, "-m", "cozyebpf"]


#: The modules that take longest (minutes each), run first: scripts/test.sh runs the files on
#: parallel workers (pytest-xdist, --dist loadfile), and a worker that starts one of these last
#: would run it alone at the end. The order of the others is kept.
SLOW_FIRST = (  # by their share of a sequential run (--durations), largest first
    "test_vagrant_vm.py",  # a VM under emulation: about 17 minutes, two CPUs for qemu
    "test_differential.py",
    "test_kernel_guest.py",  # a qemu guest: one CPU busy for about two minutes
    "test_stop_points.py",
    "test_kube_e2e.py",
    "test_lifecycle.py",
    "test_upgrade.py",
    "test_zero_downtime.py",
    "test_releases.py",
    "test_reserved.py",
    "test_cluster_lab.py",
    "test_real_ovn.py",
)


def _slow_first(item: pytest.Item) -> int:
    name = item.path.name
    return SLOW_FIRST.index(name) if name in SLOW_FIRST else len(SLOW_FIRST)


#: the cluster lab's tables, as a worker of pytest-xdist hands them over
_WORKER_TABLES: dict[str, str] = {}


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: the cluster lab's tables go to the controller, which prints
    them (pytest_terminal_summary)."""
    output = getattr(session.config, "workeroutput", None)
    tables = _lab_tables()
    if output is not None and tables:
        output["cluster_lab_tables"] = tables


#: the test modules of the cluster labs, whose TABLES the summary prints
LAB_MODULES = ("tests.datapath.test_cluster_lab", "tests.datapath.test_real_ovn")


def _lab_tables() -> dict[str, str]:
    out: dict[str, str] = {}
    for name in LAB_MODULES:
        out.update(getattr(sys.modules.get(name), "TABLES", {}))
    return out


class _WorkerTables:
    """pytest-xdist's controller: the tables its workers handed over (a hook of xdist's, so
    registered only where xdist is)."""

    @staticmethod
    def pytest_testnodedown(node: Any, error: Any) -> None:
        _WORKER_TABLES.update(getattr(node, "workeroutput", {}).get("cluster_lab_tables", {}))


def pytest_configure(config: pytest.Config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WorkerTables())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The cluster labs' tables (tests/datapath/test_cluster_lab.py, test_real_ovn.py),
    whatever the verdicts, so that every run's log shows them (with parallel workers, from the
    worker that ran each)."""
    for layout, table in {**_lab_tables(), **_WORKER_TABLES}.items():
        terminalreporter.section(f"cluster lab: {layout}")
        terminalreporter.write_line(table)


@pytest.fixture(scope="module")
def alone_with_qemu_and_the_nodes() -> Iterator[None]:
    """The modules that keep CPUs busy for minutes, a qemu guest under emulation (the kernel
    matrix's, the Vagrant VM's) or the real-node lab's two nodes, run one at a time across the
    workers of pytest-xdist. The real-node lab counts every packet lost through a killed agent,
    an upgrade and a rollback on two cores; in a CI run where a guest's qemu (a whole CPU for
    minutes) ran beside it, its killed agent lost 155 of 12,807 UDP datagrams (the lab alone:
    0 of 8,444). An exclusive lock on a file, held for the module."""
    path = Path(tempfile.gettempdir()) / "cozyebpf-tests-heavy.lock"
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
