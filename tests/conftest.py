"""Shared fixtures. Datapath tests (marker `datapath`) need root, bcc, kernel headers, bpffs and
iproute2. Outside CI a missing prerequisite skips them with the reason; under CI=true it FAILS
them, so a CI run can never pass without exercising the datapath."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.env import IN_CI, TEST_CMD


def _missing_prerequisites() -> list[str]:
    missing = []
    if os.geteuid() != 0:
        missing.append("root (run as root: the tests load BPF programs and make namespaces)")
    try:
        import bcc  # noqa: F401
    except ImportError:
        missing.append(
            "bcc (apt-get install python3-bpfcc; use the .venv made by scripts/setup.sh)"
        )
    build = Path(f"/lib/modules/{os.uname().release}/build")
    if not build.exists():
        missing.append(f"kernel headers at {build} (run scripts/setup.sh)")
    if not os.path.ismount("/sys/fs/bpf"):
        missing.append("bpffs at /sys/fs/bpf (mount -t bpf bpf /sys/fs/bpf)")
    for tool in ("ip", "nsenter", "nft", "curl", "ping"):
        if not shutil.which(tool):
            missing.append(f"the {tool} command")
    return missing


_MISSING = _missing_prerequisites()


@pytest.fixture(autouse=True)
def _datapath_prerequisites(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("datapath") is None or not _MISSING:
        return
    msg = "datapath prerequisites missing: " + "; ".join(_MISSING)
    if IN_CI:
        pytest.fail(msg + " (CI=true: datapath tests must run)", pytrace=False)
    pytest.skip(msg)


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
    """The cluster lab's tables (tests/datapath/test_cluster_lab.py), whatever the verdicts, so that
    every run's log shows them."""
    mod = sys.modules.get("tests.datapath.test_cluster_lab")
    for layout, table in getattr(mod, "TABLES", {}).items():
        terminalreporter.section(f"cluster lab: {layout}")
        terminalreporter.write_line(table)
