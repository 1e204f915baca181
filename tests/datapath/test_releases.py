"""Releases side by side (issue 30): the agent runs its own code wherever it is started, and
an agent meets the maps of a newer release as the compatibility contract says (docs/design.md,
*Releases and map layouts*)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import ip_address
from pathlib import Path

import pytest

from cozyebpf import __version__
from cozyebpf.datapath.layout import ALL_MAPS, LAYOUT_VERSION, OLDEST_COMPATIBLE
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.datapath.pins import PinnedLayout, read_pinned_meta
from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP, DEFAULT_PODS, UPLINK
from cozylab.realnode.refused import refused_here
from cozylab.traffic import Download, NewFlows, Pusher, TcpChat, flowing, line_echo
from tests.support.env import IN_CI
from tests.support.labtools import (
    AgentLab,
    agent_lab,
    mark_pins,
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


# -- both directions under traffic: the previous release and this one, each way ---------------


def previous_release_tree(repo: Path, dest: Path) -> tuple[str, Path]:
    """The previous release's version and source tree (pyproject.toml names its commit),
    unpacked from git into `dest`."""
    import tomllib

    prev = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["cozyebpf"][
        "previous-release"
    ]
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", prev["commit"]], capture_output=True
    )
    if archive.returncode != 0:
        msg = f"the previous release's commit {prev['commit']} is not in {repo}: "
        msg += archive.stderr.decode().strip()
        if IN_CI:
            pytest.fail(msg + " (CI runs in a full clone)", pytrace=False)
        pytest.skip(msg)
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    init = (dest / "cozyebpf/__init__.py").read_text()
    assert f'__version__ = "{prev["version"]}"' in init
    return str(prev["version"]), dest


def installed_release(tree: Path, dest: Path) -> dict[str, str]:
    """The release's tree installed as its image installs it (Dockerfile: a regular, not
    editable, `pip install` of the package; bpf/ beside it, named by COZYEBPF_BPF_DIR), into
    `dest`; the environment that runs it with this Python."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--disable-pip-version-check",
            "--target",
            str(dest),
            str(tree),
        ],
        check=True,
        capture_output=True,
    )
    env = {"PYTHONPATH": str(dest), "PYTHONSAFEPATH": "1", "COZYEBPF_BPF_DIR": str(tree / "bpf")}
    where = subprocess.run(
        [sys.executable, "-c", "import cozyebpf; print(cozyebpf.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    ).stdout.strip()
    assert where == str(dest / "cozyebpf" / "__init__.py"), where
    return env


def previous_maps(tree: Path) -> set[str]:
    """The maps of the previous release's registry (its layout.py, run from its tree)."""
    p = subprocess.run(
        [
            sys.executable,
            "-c",
            "from cozyebpf.datapath.layout import ALL_MAPS; print(*(m.name for m in ALL_MAPS))",
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(tree), "PYTHONSAFEPATH": "1"},
    )
    return set(p.stdout.split())


@dataclass
class Switches:
    """The issue's traffic while the agents change: UDP echo to a whole-IP LB IP (a new flow
    for each request), TCP through a port filter, a download the port-filter pod opened, new
    UDP flows that pod opens every few ms, and an idle connection it opened, answered at the
    end (its flow must outlive every change)."""

    env: AgentLab
    echo: NewFlows
    chat: TcpChat
    download: Download
    flows: NewFlows

    def all(self) -> list[NewFlows | TcpChat | Download]:
        return [self.echo, self.chat, self.download, self.flows]

    def check(self) -> None:
        for f in (self.echo, self.flows):
            assert f.sent > 200 and f.lost == [], f"{f.dst}: {len(f.lost)} of {f.sent} lost"
        assert self.chat.error is None and self.chat.rounds > 50, self.chat.error
        assert self.download.error is None, self.download.error
        assert self.download.answered > 400


@contextlib.contextmanager
def switches(env: AgentLab) -> Iterator[tuple[Switches, Callable[[], bytes]]]:
    """Start the traffic (the agent runs); yield it and the idle connection's answer-later;
    stop it at the end."""
    lab = env.lab
    pod1, pod2 = lab.pod_ns(POD1), lab.pod_ns(POD2)
    with (
        serve(lab, pod1, socket.SOCK_DGRAM, 9106, udp_echo),
        serve(lab, pod2, socket.SOCK_STREAM, 80, line_echo),
        Pusher(lab, lab.client, 9107, chunk=1024, every=0.002),  # sends until the pod goes
        pod_flows(env) as answer_later,  # UDP 9105 (echo) and the idle TCP connection
    ):
        t = Switches(
            env,
            NewFlows(lab, lab.client, (LB_WHOLE, 9106)),
            TcpChat(lab, lab.client, (LB_FILT, 80)),
            # its data passes only by the pod's flow: a lost flow stalls it for good
            Download(lab, pod2, (CLIENT_IP, 9107), stall=5),
            NewFlows(lab, pod2, (CLIENT_IP, 9105)),
        )
        for s in t.all():
            s.start()
        try:
            yield t, answer_later
        finally:
            for s in t.all():
                s.stop()


def test_upgrade_from_the_previous_release_and_back_under_traffic(
    tmp_path: Path, cozyebpf_cmd: list[str], repo_root: Path
) -> None:
    """The previous release (its tree from git at its release commit, installed as its image
    installs it) runs the node; this release replaces it, then the previous one comes back (helm
    upgrade, helm rollback). Under the issue's traffic not one request or answer is lost, the
    download never stalls, and the idle connection the pod opened before the upgrade is
    answered after the rollback: its flow outlived both. (0.3.0 -> main -> 0.3.0 lost
    thousands of packets and reset the download while `addrhint` had two meanings in layout 7,
    issue 45.)"""
    version, old = previous_release_tree(repo_root, tmp_path / "previous")
    prev_env = installed_release(old, tmp_path / "installed")
    said = subprocess.run(
        [sys.executable, "-m", "cozyebpf", "--version"],
        capture_output=True,
        text=True,
        env={**os.environ, **prev_env},
    )
    # its own code (0.1.0 said "cozyebpf, version 0.1.0"; from 0.2.0 on the layouts too)
    assert said.stdout.startswith((f"cozyebpf, version {version}\n", f"cozyebpf {version} ")), (
        said.stdout + said.stderr
    )
    # its map layout, from its own types.h (0.3.0: 7; this release adds rolehint and other
    # late maps to layout 7)
    types = (old / "bpf" / "lib" / "types.h").read_text()
    found = re.search(r"#define CZ_LAYOUT_VERSION (\d+)", types)
    assert found is not None
    old_layout = int(found.group(1))
    manifest_text = manifest(WHOLE, FILT)
    with agent_lab("v", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2], manifest_text) as env:
        new_cmd = env.cmd

        def run_previous() -> None:
            # its own package as installed and its bpf/ with this Python (PYTHONSAFEPATH: not
            # the working directory's package, for its compiler child too)
            env.cmd = [sys.executable, "-m", "cozyebpf"]
            env.env.update(prev_env)
            env.start_agent()

        def run_this() -> None:
            for k in prev_env:
                del env.env[k]
            env.cmd = new_cmd
            env.start_agent()

        refused = refused_here(old)
        if refused is not None:
            upgrade_where_the_previous_cannot_run(env, run_previous, run_this, refused)
            return
        run_previous()
        env.set_services(WHOLE, FILT)
        # its own code, not this tree's (the same version between releases): it pins none of
        # the maps that only this release has
        assert not set(env.map_ids()) & ({s.name for s in ALL_MAPS} - previous_maps(old))
        prev_meta = read_pinned_meta(env.pin_dir)
        assert prev_meta is not None and prev_meta.version == old_layout
        assert prev_meta.release in ("", version)  # 0.1.0 recorded no release
        with switches(env) as (traffic, answer_later):
            maps = env.map_ids()
            flowing(traffic.all(), udp=0, tcp=30, other=150)
            assert env.stop_agent(signal.SIGTERM) == 0
            run_this()  # the upgrade
            flowing(traffic.all(), udp=0, tcp=30, other=150)
            assert read_pinned_meta(env.pin_dir) == PinnedLayout(
                LAYOUT_VERSION, OLDEST_COMPATIBLE, __version__
            )
            assert env.stop_agent(signal.SIGTERM) == 0
            run_previous()  # the rollback
            flowing(traffic.all(), udp=0, tcp=30, other=150)
            assert answer_later() == b"later"
            # the maps this release added stay pinned, unused by the previous one
            added = {k: v for k, v in env.map_ids().items() if k not in maps}
            assert env.map_ids() == {**maps, **added}, "every map kept, both ways"
            assert set(added) == {s.name for s in ALL_MAPS} - previous_maps(old)
        traffic.check()
        assert "rebuilt map" not in env.log() and "migrated map" not in env.log()
        env.set_services(WHOLE)


def upgrade_where_the_previous_cannot_run(
    env: AgentLab,
    run_previous: Callable[[], None],
    run_this: Callable[[], None],
    refused: str,
) -> None:
    """The upgrade and the rollback on a kernel whose verifier refuses a helper the previous
    release calls (6.18.44-fc-v1300 and 0.3.0: bpf_xdp_adjust_meta). The previous release, its
    own code, fails at start and says why; this release, started over the maps it left, runs
    the node; the rollback to it fails the same way and leaves this release's programs
    attached, so the issue's traffic goes on through it without one loss, and the idle
    connection the pod opened is answered when this release is back. What only a kernel that
    lets the previous release load proves (its programs under traffic, both ways) the kernel
    matrix's guests have (Debian's 6.1 and 6.12 allow the helper)."""
    said = start_refused_previous(env, run_previous)
    assert "bpf_xdp_adjust_meta" in said, f"{refused}; it said:\n{said}"
    run_this()  # the upgrade: a start over whatever the failed one left pinned
    env.set_services(WHOLE, FILT)
    assert "refuses bpf_xdp_adjust_meta" in env.log()  # the fallback, logged
    with switches(env) as (traffic, answer_later):
        maps, links = env.map_ids(), env.links()
        flowing(traffic.all(), udp=0, tcp=30, other=150)
        assert env.stop_agent(signal.SIGTERM) == 0
        said = start_refused_previous(env, run_previous)  # the rollback
        assert "bpf_xdp_adjust_meta" in said, said
        assert env.links() == links, "the failed rollback changed the attachments"
        flowing(traffic.all(), udp=0, tcp=30, other=150)
        run_this()  # rolled forward again
        flowing(traffic.all(), udp=0, tcp=30, other=150)
        assert answer_later() == b"later"
        assert env.map_ids() == maps, "every map kept, both ways"
    traffic.check()
    env.set_services(WHOLE)


def start_refused_previous(env: AgentLab, run_previous: Callable[[], None]) -> str:
    """run_previous where the previous release cannot load: it exits at start; its log."""
    offset = len(env.log())
    with pytest.raises(AssertionError):
        run_previous()  # start_agent asserts that the agent still runs once it attached
    assert env.proc is not None
    rc = env.proc.wait(timeout=20)
    env.proc = None
    said = env.log()[offset:]
    assert rc != 0, said
    return said


def test_a_newer_additive_layout_under_traffic(filt: AgentLab) -> None:
    """The other direction of the contract, under the same traffic: this release's agent
    stopped, its pins marked as a newer release's whose layout names this one compatible,
    the agent started again. Nothing is lost, the idle connection is answered."""
    env = filt
    env.start_agent()
    env.set_services(WHOLE, FILT)
    with switches(env) as (traffic, answer_later):
        maps = env.map_ids()
        flowing(traffic.all(), udp=0, tcp=30, other=150)
        assert env.stop_agent(signal.SIGTERM) == 0
        mark_pins(env.pin_dir, LAYOUT_VERSION + 1, LAYOUT_VERSION, "9.0.0")
        env.start_agent()
        flowing(traffic.all(), udp=0, tcp=30, other=150)
        assert answer_later() == b"later"
        assert env.map_ids() == maps
    traffic.check()
    assert "rebuilt map" not in env.log()
