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


class _Agent:
    """A /status server on 127.0.0.1 that counts the requests it gets (the agent's part of
    `status` and of `maps dump`)."""

    def __init__(self, refused: list[dict[str, str]]) -> None:
        import http.server
        import json
        import threading

        asked = self.asked = []  # type: list[str]
        body = json.dumps({"refused": refused, "error_free": True}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                asked.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


REFUSED = {"service": "default/vm9", "lb_ip": "192.0.2.9", "why": "the node's address"}


@pytest.mark.parametrize(
    ("env", "args", "asked", "shown"),
    [
        # the demo's case: an agent that serves no /status is never asked, and nothing is said
        ({}, [], 0, None),
        ({"COZYEBPF_RUN_HEALTH_ADDRESS": "AGENT"}, [], 1, "refused, not programmed"),
        ({}, ["--agent", "AGENT"], 1, "refused, not programmed"),
        ({}, ["--agent", "127.0.0.1:1"], 0, "refused Services unknown: cannot reach the agent"),
    ],
    ids=["no-address", "daemonset-env", "agent-option", "agent-unreachable"],
)
def test_maps_dump_asks_an_agent_only_at_an_address_given(
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    args: list[str],
    asked: int,
    shown: str | None,
) -> None:
    """`maps dump` asks the agent for its refused Services only at the address of
    --agent or COZYEBPF_RUN_HEALTH_ADDRESS (the DaemonSet's), and says nothing about an
    agent when none was given; an address given and unreachable is said."""
    from click.testing import CliRunner

    import cozyebpf.dump
    from cozyebpf.cli import main
    from cozyebpf.state import MapState

    agent = _Agent([REFUSED])
    try:
        monkeypatch.setattr(
            cozyebpf.dump,
            "dump_pinned",
            lambda p: cozyebpf.dump.build_dump(MapState(), pin_dir=p),
        )
        for name in ("COZYEBPF_STATUS_AGENT", "COZYEBPF_RUN_HEALTH_ADDRESS"):
            monkeypatch.delenv(name, raising=False)
        env = {k: v.replace("AGENT", agent.address) for k, v in env.items()}
        argv = [a.replace("AGENT", agent.address) for a in args]
        r = CliRunner().invoke(main, ["maps", "dump", *argv], env=env)
        assert r.exit_code == 0, r.output
        assert len(agent.asked) == asked
        refused_lines = [x for x in r.output.splitlines() if "refused" in x or "agent" in x]
        if shown is None:
            assert refused_lines == [], r.output
        else:
            assert len(refused_lines) == 1 and refused_lines[0].startswith(shown), r.output
    finally:
        agent.close()


def test_status_without_an_agent_address_says_it_did_not_ask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`status` with no agent address asks none and says how to give one (no error)."""
    from click.testing import CliRunner

    import cozyebpf.status
    from cozyebpf.cli import main

    seen: list[str] = []
    monkeypatch.setattr(cozyebpf.status, "datapath_status", lambda p: {"pin_dir": p, "error": "x"})
    monkeypatch.setattr(cozyebpf.status, "fetch_agent", lambda a: seen.append(a) or {})
    for name in ("COZYEBPF_STATUS_AGENT", "COZYEBPF_RUN_HEALTH_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    r = CliRunner().invoke(main, ["status", "--pin-dir", "/sys/fs/bpf/test"])
    assert r.exit_code == 0, r.output
    assert seen == []
    assert r.output.splitlines()[-1] == f"agent: {cozyebpf.status.NOT_ASKED}"
