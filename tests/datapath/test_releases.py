"""Releases side by side (issue 30): the agent runs its own code wherever it is started, and
an agent meets the maps of a newer release as the compatibility contract says (docs/design.md,
*Releases and map layouts*)."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
from collections.abc import Callable, Iterator
from ipaddress import ip_address
from pathlib import Path

import pytest

from cozyebpf import __version__
from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import LAYOUT_VERSION, MetaVal
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.pins import release_parts
from cozyebpf.lab import CLIENT_IP, DEFAULT_PODS, UPLINK
from tests.support.k8s import Svc, manifest
from tests.support.labtools import (
    AgentLab,
    agent_lab,
    serve,
    tcp_echo,
    tcp_talk,
    udp_echo,
    udp_talk,
)
from tests.support.packets import LB_FILT, LB_WHOLE
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


FILT = Svc("vm2", LB_FILT, POD2.ip, [("TCP", 80)])


@pytest.fixture
def filt(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("r", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(FILT)) as env:
        yield env


@contextlib.contextmanager
def pod_flows(env: AgentLab) -> Iterator[Callable[[], bytes]]:
    """Two flows the port-filter pod opened: a UDP exchange with the client, and a TCP
    connection to it left idle. Yields a function that has the client answer the idle
    connection and returns what the pod got (its flow must still admit the answer)."""
    lab = env.lab
    with (
        serve(lab, lab.client, socket.SOCK_DGRAM, 9105, udp_echo),
        lab.ns_socket(lab.client, socket.AF_INET, socket.SOCK_STREAM) as listener,
    ):
        listener.bind(("0.0.0.0", 9103))
        listener.listen(1)
        answer, _ = udp_talk(lab, lab.pod_ns(POD2), CLIENT_IP, 9105, b"udp")
        assert answer == f"{LB_FILT} udp".encode(), "the pod is seen as its LB IP"
        with lab.ns_socket(lab.pod_ns(POD2), socket.AF_INET, socket.SOCK_STREAM) as idle:
            idle.settimeout(5)
            idle.connect((CLIENT_IP, 9103))
            conn, peer = listener.accept()
            assert peer[0] == LB_FILT
            with conn:

                def answer_later() -> bytes:
                    conn.sendall(b"later")
                    return idle.recv(64)

                yield answer_later


def flows_of(env: AgentLab, pod: str) -> int:
    with PinnedMaps.open(env.pin_dir) as m:
        return m.flows_by_pod().get(ip_address(pod), 0)


def mark_pins(pin_dir: str, version: int, oldest: int, release: str) -> None:
    """Make the pins say that release `release`, with layout `version`, wrote them, and that
    layout `oldest` or newer can run on them: the maps of a newer release, played by this
    one's (its agent stopped)."""
    major, minor, patch = release_parts(release)
    fd = bpfsys.obj_get(f"{pin_dir}/meta")
    try:
        val = MetaVal(
            layout_version=version,
            oldest_compatible=oldest,
            release_major=major,
            release_minor=minor,
            release_patch=patch,
        )
        bpfsys.map_update(fd, ctypes.c_uint32(0), val)
    finally:
        os.close(fd)


def test_a_rollback_onto_a_newer_compatible_layout_keeps_every_flow(filt: AgentLab) -> None:
    """The issue's rollback, played with this release: its agent stopped, its pins marked as
    a newer release's whose layout only added, the agent started again. The maps are run on
    as they are: the flows go from 2 to 2 (they went to 0), and the idle connection the pod
    opened gets its answer."""
    env = filt
    env.start_agent()
    env.set_services(FILT)
    with pod_flows(env) as answer_later:
        assert flows_of(env, POD2.ip) == 2
        maps_before, links_before = env.map_ids(), env.links()
        assert env.stop_agent(signal.SIGTERM) == 0
        mark_pins(env.pin_dir, LAYOUT_VERSION + 1, LAYOUT_VERSION, "9.0.0")
        env.start_agent()
        assert "written by cozyebpf 9.0.0" in env.log() and "every map of this layout" in env.log()
        assert flows_of(env, POD2.ip) == 2, env.log()[-3000:]
        assert env.map_ids() == maps_before, "every map kept as it is"
        assert {k: v[0] for k, v in env.links().items()} == {
            k: v[0] for k, v in links_before.items()
        }, "the links replaced in place"
        assert answer_later() == b"later"
    assert env.layout_version() == LAYOUT_VERSION  # it records its own layout


def test_a_newer_layout_it_cannot_run_on_is_left_attached(filt: AgentLab) -> None:
    """Pins of a newer release that this layout cannot run on: the agent exits with an error
    naming both layouts and that release, and changes nothing: the maps, the programs attached
    and the flows stay (traffic goes on), and `cozyebpf status` says why."""
    env = filt
    env.start_agent()
    env.set_services(FILT)
    with pod_flows(env) as answer_later:
        assert env.stop_agent(signal.SIGTERM) == 0
        new = LAYOUT_VERSION + 1
        mark_pins(env.pin_dir, new, new, "9.0.0")
        maps_before, links_before = env.map_ids(), env.links()
        p = env.lab.exec(
            env.lab.node,
            *env.cmd,
            "run",
            "--manifests",
            str(env.manifest_path),
            "--devices",
            UPLINK,
            "--pin-dir",
            env.pin_dir,
            check=False,
            timeout=120,
        )
        assert p.returncode == 1, p.stdout + p.stderr
        want = (
            f"cozyebpf: error: the maps in {env.pin_dir} have layout {new}, written by "
            f"cozyebpf 9.0.0, and need layout {new} or newer; this cozyebpf {__version__} has "
            f"layout {LAYOUT_VERSION}. Nothing was changed"
        )
        assert want in p.stderr, p.stderr
        assert env.map_ids() == maps_before and env.links() == links_before
        assert answer_later() == b"later", "the flows still admit the answers"
        st = json.loads(
            env.lab.exec(
                env.lab.node, *env.cmd, "status", "--json", "--pin-dir", env.pin_dir
            ).stdout
        )["datapath"]
        assert st["layout"] == {"layout_version": new, "oldest": new, "written_by": "9.0.0"}
        assert "cannot read them" in st["error"] and len(st["attachments"]) == 2
