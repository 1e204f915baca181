"""Shared fixtures, and what each test needs from the machine (tests/support/prereqs.py).

Tests under tests/datapath get the marker `datapath` (root, bcc, kernel headers, bpffs, the
lab's commands); `requires(...)` names further prerequisites, and some fixtures need their own
(`helm`). They are checked at collection:
outside CI a test whose prerequisites are missing is skipped with the reason before any of its
fixtures runs; under CI=true it FAILS, so a CI run can never pass without exercising the
datapath."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support import prereqs
from tests.support.env import IN_CI, TEST_CMD

DATAPATH_DIR = Path(__file__).resolve().parent / "datapath"
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
            missing = prereqs.missing_of(needs(item))
            if not missing:
                continue
            reason = "missing: " + "; ".join(missing)
            if IN_CI:
                item.stash[_MISSING] = reason
            else:
                item.add_marker(pytest.mark.skip(reason=reason))
    except ValueError as e:  # an unknown name in a marker or COZYEBPF_TEST_MISSING
        raise pytest.UsageError(str(e)) from None


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


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The cluster labs' tables (tests/datapath/test_cluster_lab.py, test_real_ovn.py),
    whatever the verdicts, so that every run's log shows them."""
    for name in ("tests.datapath.test_cluster_lab", "tests.datapath.test_real_ovn"):
        mod = sys.modules.get(name)
        for layout, table in getattr(mod, "TABLES", {}).items():
            terminalreporter.section(f"cluster lab: {layout}")
            terminalreporter.write_line(table)
