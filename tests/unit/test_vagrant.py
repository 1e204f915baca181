"""The Vagrant VM's files (vagrant/, scripts/vagrant-*.sh; issue 47), checked without a VM:
the packet tests are named in one place (tests/conftest.py, PACKET_TESTS) and what the VM runs
selects them by their marker; every shell script parses and passes shellcheck (vagrant/k8s.sh
and vagrant/e2e.sh too, which need the Internet and never run here). `make vagrant-lab` runs
the VM itself; tests/datapath/test_vagrant_e2e.py applies e2e.sh's manifests to the labs' API
server."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import DATAPATH_DIR, PACKET_TESTS

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = (
    REPO / "vagrant" / "in-vm.sh",
    REPO / "vagrant" / "k8s.sh",
    REPO / "vagrant" / "e2e.sh",
    REPO / "scripts" / "vagrant-box.sh",
    REPO / "scripts" / "vagrant-lab.sh",
)


def test_the_packet_tests_are_datapath_files() -> None:
    assert PACKET_TESTS, "no packet tests"
    for name in PACKET_TESTS:
        assert (DATAPATH_DIR / name).is_file(), f"PACKET_TESTS names {name}, not in {DATAPATH_DIR}"


def test_the_vm_selects_the_packet_tests_by_their_marker_only() -> None:
    """The subset is named once: the VM runs `pytest -m packet`, and neither the Vagrantfile
    nor the scripts name a test file."""
    in_vm = (REPO / "vagrant" / "in-vm.sh").read_text()
    assert re.search(r"-m pytest .*-m packet\b", in_vm), "in-vm.sh does not run pytest -m packet"
    vagrantfile = (REPO / "vagrant" / "Vagrantfile").read_text()
    assert 'inline: "bash /cozyebpf/vagrant/in-vm.sh test"' in vagrantfile
    for path in (REPO / "vagrant" / "Vagrantfile", *SCRIPTS):
        named = re.findall(r"test_\w+\.py", path.read_text())
        assert not named, f"{path.name} names test files {named}: the marker packet selects them"


def test_the_packet_marker_is_declared() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^\s*"packet: ', pyproject, re.M), "pyproject.toml does not declare packet"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script: Path) -> None:
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.requires("shellcheck")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck_finds_no_warning(script: Path) -> None:
    out = subprocess.run(
        ["shellcheck", "-x", "-S", "warning", str(script)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stdout + out.stderr
