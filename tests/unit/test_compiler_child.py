"""The compiler child runs the agent's own package, never a `cozyebpf/` in its working
directory (issue 30): the agent may be started anywhere, and the child holds CAP_SYS_ADMIN."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cozyebpf.datapath.compiler import Request, child_command, package_root

REPO = Path(__file__).resolve().parents[2]


def booby_trap(where: Path) -> Path:
    """A `cozyebpf/` package in `where` that leaves a marker and exits 99 when imported; the
    marker's path."""
    marker = where / "trap-sprung"
    pkg = where / "cozyebpf"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        f"import os\nopen({str(marker)!r}, 'w').write('imported')\nos._exit(99)\n"
    )
    return marker


def test_the_child_does_not_import_the_working_directory(tmp_path: Path) -> None:
    marker = booby_trap(tmp_path)
    cmd = child_command("/sys/fs/bpf/x", 0, [Request("cz_egress", "sched_cls")])
    # --help: argparse answers once the child's own module (and cozyebpf) is imported
    p = subprocess.run([*cmd, "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "usage: python -m cozyebpf.datapath.compiler" in p.stdout
    assert not marker.exists(), "the child imported the working directory's cozyebpf"


def test_the_way_it_was_imports_the_trap(tmp_path: Path) -> None:
    """The trap works: `python -m` from that directory (the child's command before) springs
    it. So the test above can fail."""
    marker = booby_trap(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "cozyebpf.datapath.compiler", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert p.returncode == 99 and marker.read_text() == "imported"


def test_the_child_runs_the_agents_package() -> None:
    assert Path(package_root()) / "cozyebpf" == REPO / "cozyebpf"
    cmd = child_command("/sys/fs/bpf/x", 0, [])
    assert cmd[:3] == [sys.executable, "-P", "-c"] and cmd[4] == package_root()
