"""The command line's errors: every command ends a failure it expects in one line
`cozyebpf: error: ...` and exit status 1, never in a Python traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["detach"], "is not on a bpf filesystem: not a cozyebpf pin dir"),
        (["maps", "dump"], "no cozyebpf map pinned at"),
        (["maps", "dump", "--json"], "no cozyebpf map pinned at"),
    ],
    ids=["detach", "maps-dump", "maps-dump-json"],
)
def test_a_pin_dir_that_is_not_ours_is_one_line_of_error(
    cozyebpf_cmd: list[str], tmp_path: Path, args: list[str], message: str
) -> None:
    p = subprocess.run(
        [*cozyebpf_cmd, *args, "--pin-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    errors = [line for line in p.stderr.splitlines() if not line.startswith("entrypoint: ")]
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert len(errors) == 1 and errors[0].startswith("cozyebpf: error: "), p.stderr
    assert message in errors[0] and str(tmp_path) in errors[0], p.stderr
    assert p.stdout == "", p.stdout
    assert tmp_path.is_dir(), "a directory that is not ours is never removed"
