"""The prerequisite check itself (tests/conftest.py, tests/support/prereqs.py): pytest runs in a
subprocess on real test modules with a prerequisite missing. Outside CI the tests that need it
are skipped with the reason, before any fixture runs (tests/datapath/test_prog_run.py loads its
programs in a module-scoped fixture, which would error without bcc); under CI=true they fail.
Tests that do not need it run either way."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.support import prereqs

#: tests that need the datapath (a module-scoped fixture loads BPF) and tests that need nothing
DATAPATH_TESTS = ["tests/datapath/test_prog_run.py::test_replies_to_pod_flows_pass"]
UNIT_TESTS = ["tests/unit/test_pod_devices.py"]


def run_pytest(
    repo_root: Path, tmp_path: Path, env: dict[str, str], *args: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, tuple[str, str]]]:
    """pytest on `args` from the repository root; its exit and each test's outcome
    (passed/skipped/failed/error) with its message, from the JUnit XML report."""
    report = tmp_path / "report.xml"
    base = {k: v for k, v in os.environ.items() if k not in ("CI", prereqs.FORCE_ENV)}
    base.pop("PYTEST_ADDOPTS", None)
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
        cwd=repo_root,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("skipped", "failure", "error"):
            el = case.find(kind)
            if el is not None:
                outcome, message = kind, el.get("message", "")
        outcomes[f"{case.get('classname')}::{case.get('name')}"] = (outcome, message)
    return p, outcomes


def _pythonpath(repo_root: Path, *first: Path) -> str:
    return os.pathsep.join([*map(str, first), str(repo_root)])


def _without_bcc(repo_root: Path, tmp_path: Path) -> dict[str, str]:
    """A `bcc` package first on the path that cannot be imported: a machine without bcc."""
    shadow = tmp_path / "shadow"
    (shadow / "bcc").mkdir(parents=True)
    (shadow / "bcc" / "__init__.py").write_text("raise ImportError('no bcc on this machine')\n")
    return {"PYTHONPATH": _pythonpath(repo_root, shadow)}


HOW = {
    # the real check, fooled by the path: `import bcc` fails
    "bcc-not-importable": (_without_bcc, "bcc (no bcc on this machine"),
    # the check forced: as on a machine where the tests do not run as root
    "root-forced": (
        lambda root, _: {"PYTHONPATH": str(root), prereqs.FORCE_ENV: "root"},
        "root (COZYEBPF_TEST_MISSING",
    ),
}


@pytest.mark.parametrize("ci", [False, True], ids=["laptop", "CI=true"])
@pytest.mark.parametrize("how", list(HOW))
def test_a_missing_prerequisite_skips_outside_ci_and_fails_under_ci(
    repo_root: Path, tmp_path: Path, how: str, ci: bool
) -> None:
    make_env, reason = HOW[how]
    env = make_env(repo_root, tmp_path)
    if ci:
        env["CI"] = "true"
    p, outcomes = run_pytest(repo_root, tmp_path, env, *UNIT_TESTS, *DATAPATH_TESTS)
    log = p.stdout + p.stderr
    datapath = {k: v for k, v in outcomes.items() if ".datapath." in k}
    unit = {k: v for k, v in outcomes.items() if ".unit." in k}
    assert len(datapath) == 3 and unit, log
    assert {o for o, _ in unit.values()} == {"passed"}, log
    for outcome, message in datapath.values():
        assert reason in message, log
        if ci:  # failed in setup, before the module's fixture: our message, not bcc's error
            assert outcome == "error" and "CI=true: these tests must run" in message, log
        else:
            assert outcome == "skipped", log
    assert p.returncode == (1 if ci else 0), log


def test_a_fixture_can_need_a_prerequisite(repo_root: Path, tmp_path: Path) -> None:
    """Chart tests that take the `helm` fixture skip without helm; the others run."""
    env = {"PYTHONPATH": str(repo_root), prereqs.FORCE_ENV: "helm"}
    p, outcomes = run_pytest(
        repo_root, tmp_path, env, "tests/unit/test_chart.py", "-k", "lint or every_value"
    )
    log = p.stdout + p.stderr
    by_test = {k.rpartition("::")[2]: v for k, v in outcomes.items()}
    assert by_test["test_every_value_is_in_the_schema"] == ("passed", ""), log
    lint = [v for k, v in by_test.items() if k.startswith("test_helm_lint_strict")]
    assert lint and all(o == "skipped" and "helm (COZYEBPF_TEST_MISSING" in m for o, m in lint)


def test_an_unknown_prerequisite_is_a_usage_error(repo_root: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(repo_root), prereqs.FORCE_ENV: "bcc,nonesuch"}
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *UNIT_TESTS],
        cwd=repo_root,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == pytest.ExitCode.USAGE_ERROR, p.stdout + p.stderr
    assert "unknown prerequisites nonesuch" in p.stderr


def test_the_labs_prerequisites_are_missing_without_go_not_an_error(repo_root: Path) -> None:
    """Without Go, build-kube.sh and build-node.sh cannot say where their binaries go: the
    labs' prerequisites are missing (skipped, or failed under CI=true), and collecting the
    suite does not stop with an internal error (the Vagrant VM has no Go)."""
    code = (
        "from tests.support import prereqs\n"
        "for n in ('kube', 'real-node'):\n"
        "    print(n, prereqs.missing(n))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        cwd=repo_root,
        env={**os.environ, "GO": "/nonexistent/go", "PYTHONPATH": str(repo_root)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["kube", "real-node"], p.stdout
    for line in lines:
        assert "/nonexistent/go" in line, line
