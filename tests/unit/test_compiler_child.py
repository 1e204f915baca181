"""The compiler child runs the agent's own package, never a `cozyebpf/` in its working
directory (issue 30): the agent may be started anywhere, and the child holds CAP_SYS_ADMIN."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


#: what bcc's compiler said at every start (bpf/lib/flow.h's `#pragma unroll` loop), beside
#: lines that must pass untouched: another warning, an error, a verifier log's lines
UNROLLED = (
    "warning: /opt/cozyebpf/bpf/lib/flow.h:156:2: loop not unrolled: the optimizer was unable "
    "to perform the requested transformation; the transformation might be disabled or "
    "specified as part of an unsupported transformation ordering"
)
KEPT = [
    "warning: /opt/cozyebpf/bpf/lib/nat.h:12:3: unused variable 'x' [-Wunused-variable]",
    "error: /opt/cozyebpf/bpf/lib/flow.h:160:2: loop not unrolled: said as an error, kept",
    "0: (bf) r6 = r1",
    "note: loop not unrolled: not a warning line, kept",
]


def test_the_compilers_unroll_warnings_stay_out_of_the_agents_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A real child writes the compiler's lines to its stderr; `forward_output` passes every
    line but the "loop not unrolled" warnings, which one DEBUG record counts."""
    import logging
    import os

    from cozyebpf.datapath.compiler import forward_output

    lines = [UNROLLED, KEPT[0], UNROLLED, *KEPT[1:], UNROLLED.replace("156:2", "201:3")]
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stderr.write(sys.argv[1])", "\n".join(lines)],
        stderr=subprocess.PIPE,
    )
    assert child.stderr is not None
    read_end, write_end = os.pipe()
    caplog.set_level(logging.DEBUG, logger="cozyebpf.datapath.compiler")
    try:
        assert forward_output(child.stderr, write_end) == 3
    finally:
        os.close(write_end)
        child.wait()
    with os.fdopen(read_end, "rb") as got:
        assert got.read().decode().splitlines() == KEPT
    assert [r.getMessage() for r in caplog.records] == [
        "compiler: 3 'loop not unrolled' warning(s) left out (/opt/cozyebpf/bpf/lib/flow.h:156:2 "
        "x2, /opt/cozyebpf/bpf/lib/flow.h:201:3 x1): a `#pragma unroll` loop stayed a loop, "
        "which the verifier takes as a bounded loop"
    ]
    assert caplog.records[0].levelname == "DEBUG"
