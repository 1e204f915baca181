"""The command line's errors: every command ends a failure it expects in one line
`cozyebpf: error: ...` and exit status 1, never in a Python traceback."""

from __future__ import annotations

import os
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


@pytest.mark.datapath
def test_run_refuses_a_pin_dir_off_bpffs_and_changes_nothing(
    cozyebpf_cmd: list[str], tmp_path: Path
) -> None:
    """`run --pin-dir /tmp`-like mistakes: an error naming the directory, before anything is
    created, attached or chmod'ed (the directory keeps its mode)."""
    tmp_path.chmod(0o1777)
    manifest = tmp_path / "m.yaml"
    manifest.write_text("")
    p = subprocess.run(
        [
            "unshare",  # a network namespace of its own: its lo is the only device
            "--net",
            *cozyebpf_cmd,
            "run",
            "--manifests",
            str(manifest),
            "--devices",
            "lo",
            "--pin-dir",
            str(tmp_path / "pins"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"cozyebpf: error: --pin-dir {tmp_path / 'pins'} is not on a bpf"), last
    assert tmp_path.stat().st_mode & 0o7777 == 0o1777
    assert not (tmp_path / "pins").exists()


def test_run_config_is_every_option_of_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` builds one RunConfig from its options (the same names, none left out), and the
    datapath from it."""
    from dataclasses import fields

    import click

    from cozyebpf.cli import main, run
    from cozyebpf.config import RunConfig

    assert [f.name for f in fields(RunConfig)] == [p.name for p in run.params]
    for k in [k for k in os.environ if k.startswith("COZYEBPF_")]:
        monkeypatch.delenv(k)
    parent = click.Context(main, auto_envvar_prefix="COZYEBPF")
    args = ["--devices", "eth9", "--counted-services", "7", "--flow-timeout-udp", "5"]
    cfg = RunConfig(**run.make_context("run", args, parent=parent).params)
    assert (cfg.devices, cfg.pod_devices, cfg.max_services) == ("eth9", "auto", 65536)
    dp = cfg.datapath(["eth9"], ["ovn0"])
    assert (dp.devices, dp.pod_devices, dp.pin_dir) == (["eth9"], ["ovn0"], cfg.pin_dir)
    assert (dp.max_services, dp.service_slots, dp.ingress_hook) == (65536, 7, "auto")
    assert dp.flow_timeouts == {"udp": 5, "icmp": 30, "tcp": 432000, "tcp_closing": 10}
