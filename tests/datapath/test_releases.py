"""Releases side by side (issue 30): the agent runs its own code wherever it is started, and
an agent meets the maps of a newer release as the compatibility contract says (docs/design.md,
*Releases and map layouts*)."""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cozyebpf.lab import DEFAULT_PODS
from tests.support.k8s import Svc, manifest
from tests.support.labtools import AgentLab, agent_lab, serve, tcp_echo, tcp_talk
from tests.support.packets import LB_WHOLE
from tests.unit.test_compiler_child import booby_trap

POD1, POD2 = DEFAULT_PODS[:2]
WHOLE = Svc("vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("r", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(WHOLE)) as env:
        yield env


def test_an_agent_started_beside_another_cozyebpf_runs_its_own(
    env: AgentLab, tmp_path: Path
) -> None:
    """Started from a directory that holds a booby-trapped `cozyebpf/` package (another
    checkout, say), the agent attaches, and neither it nor its compiler child imports it."""
    trap_dir = tmp_path / "elsewhere"
    trap_dir.mkdir()
    marker = booby_trap(trap_dir)
    env.cwd = str(trap_dir)
    if env.cmd[1:3] == ["-m", "cozyebpf"]:  # this tree's Python: the agent itself as installed
        env.cmd = [env.cmd[0], "-P", *env.cmd[1:]]
    env.start_agent()
    env.set_services(WHOLE)
    with serve(env.lab, env.lab.pod_ns(POD1), socket.SOCK_STREAM, 22, tcp_echo):
        assert tcp_talk(env.lab, env.lab.client, LB_WHOLE, 22, b"hi").endswith(b"hi")
    assert env.stop_agent(signal.SIGTERM) == 0
    assert not marker.exists(), "the agent or its compiler child imported the trap"
