"""In-place upgrades of the map layout under live traffic: an agent of an older layout runs
the datapath (the newest commit with that layout, `git archive`d, with its own package and
compiler child), it stops, and this tree's agent takes over the pinned maps and links. Not one
packet is lost: UDP streams each way, TCP connections to a whole-IP VM and from a port-filter
pod (its replies pass by the flow it opened), and a port-filter pod that opens a new UDP flow
every few milliseconds and needs every answer (flows recorded by the old egress program during
the takeover must be in the new flow hints before the new ingress program trusts them).

- layout 2 (no per-Service counters) -> this layout: the maps stay, the new ones (svcstats,
  svcnames, the monitor's, dryrun) are created, every address gets its Service's slot at the
  first sync, and the counters count from then on.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cozyebpf.datapath import bpfsys
from cozyebpf.datapath.layout import LAYOUT_VERSION
from cozyebpf.datapath.maps import PinnedMaps
from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP, DEFAULT_PODS, Lab, drain
from cozylab.traffic import NewFlows, TcpChat, UdpStream, flowing, line_echo
from tests.support.env import IN_CI, hang_bound
from tests.support.labtools import AgentLab, agent_lab, serve, udp_echo, wait_for
from tests.support.packets import LB_FILT, LB_WHOLE

POD1, POD2 = DEFAULT_PODS[:2]
WHOLE = Svc("vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc("vm2", LB_FILT, POD2.ip, [("TCP", 80), ("UDP", 9104)])


def layout_tree(repo: Path, dest: Path, version: int) -> Path:
    """The source tree of the newest commit with map layout `version` (what was running before
    the next layout was merged), unpacked into `dest`."""
    define = f"#define CZ_LAYOUT_VERSION {version}\n"

    def version_of(rev: str) -> str:
        p = subprocess.run(
            ["git", "-C", str(repo), "show", f"{rev}:bpf/lib/types.h"],
            capture_output=True,
            text=True,
        )
        return p.stdout if p.returncode == 0 else ""

    revs = subprocess.run(
        ["git", "-C", str(repo), "rev-list", "HEAD"],  # the whole history: it only grows
        capture_output=True,
        text=True,
    )
    old = next(
        (r for r in revs.stdout.split() if define in version_of(r)),
        None,
    )
    if revs.returncode != 0 or old is None:
        msg = f"no commit with map layout {version} in the history of {repo}: {revs.stderr.strip()}"
        if IN_CI:
            pytest.fail(msg + " (CI runs in a full clone)", pytrace=False)
        pytest.skip(msg)
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", old], capture_output=True, check=True
    )
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    assert define in (dest / "bpf/lib/types.h").read_text()
    return dest


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("u", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(WHOLE, FILT)) as env:
        yield env


@dataclass
class Traffic:
    """Everything that must not lose a packet while the agents change."""

    lab: Lab
    streams: list[UdpStream]
    chats: list[TcpChat]
    flows: NewFlows
    #: the old agent's pinned maps: name -> map id
    old_maps: dict[str, int] = field(default_factory=dict)

    def all(self) -> list[UdpStream | TcpChat | NewFlows]:
        return [*self.streams, *self.chats, self.flows]

    def check(self) -> None:
        for stream in self.streams:
            assert len(stream.sent) > 1000 and stream.lost() == [], stream.dst
        assert self.streams[1].peers == {LB_FILT}  # translated all along
        for chat in self.chats:
            assert chat.error is None and chat.rounds > 50
        flows = self.flows
        assert flows.sent > 200 and flows.lost == [], f"{len(flows.lost)} of {flows.sent} lost"


def upgrade_under_traffic(env: AgentLab, old: Path, old_pins: str) -> Traffic:
    """Run the agent of the tree `old` (its maps: the pin `old_pins` is there), start the
    traffic, replace the agent by this tree's, stop the traffic."""
    lab = env.lab
    new_cmd = env.cmd  # this tree's agent (or COZYEBPF_TEST_CMD's, e.g. the image's)
    # the old agent: its own package and bpf/ with this Python (PYTHONSAFEPATH: not the current
    # directory's package, for the compiler child it may start too)
    env.cmd = [sys.executable, "-m", "cozyebpf"]
    env.env.update(PYTHONPATH=str(old), PYTHONSAFEPATH="1")
    env.start_agent()  # the manifest holds WHOLE and FILT already
    wait_for(
        lambda: "now 2 services, 2 pods, 2 allowed ports" in env.log(), 10, "the old agent's sync"
    )
    assert os.path.exists(f"{env.pin_dir}/{old_pins}"), "the old agent pins its layout's maps"
    t = Traffic(
        lab,
        [
            UdpStream(lab, lab.client, (LB_WHOLE, 9100), (lab.pod_ns(POD1), 9100), 1000),
            UdpStream(lab, lab.pod_ns(POD2), (CLIENT_IP, 9101), (lab.client, 9101), 1000),
            UdpStream(lab, lab.client, (LB_FILT, 9104), (lab.pod_ns(POD2), 9104), 1000),  # allowed
        ],
        [],
        NewFlows(lab, lab.pod_ns(POD2), (CLIENT_IP, 9105)),
        old_maps=env.map_ids(),
    )
    with (
        serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, 9102, line_echo),
        serve(lab, lab.client, socket.SOCK_STREAM, 9103, line_echo),
        serve(lab, lab.client, socket.SOCK_DGRAM, 9105, udp_echo),
    ):
        t.chats = [
            TcpChat(lab, lab.client, (LB_WHOLE, 9102)),  # to the whole-IP VM
            TcpChat(lab, lab.pod_ns(POD2), (CLIENT_IP, 9103)),  # a filtered pod's own
        ]
        for s in t.all():
            s.start()
        # traffic before and after the switch, enough for Traffic.check's totals
        flowing(t.all(), udp=600, tcp=30, other=120)
        assert env.stop_agent(signal.SIGTERM) == 0
        del env.env["PYTHONPATH"], env.env["PYTHONSAFEPATH"]
        env.cmd = new_cmd
        env.start_agent()  # the upgrade
        flowing(t.all(), udp=600, tcp=30, other=120)
        for s in t.all():
            s.stop()
    return t


def test_layout_2_is_upgraded_in_place_without_a_lost_packet(
    env: AgentLab, tmp_path: Path, repo_root: Path
) -> None:
    old = layout_tree(repo_root, tmp_path / "layout2", 2)
    traffic = upgrade_under_traffic(env, old, "addr4")
    assert env.layout_version() == LAYOUT_VERSION, env.log()[-3000:]
    assert env.map_ids()["flow4"] == traffic.old_maps["flow4"], "the flows are kept"
    traffic.check()
    # the addresses carry their Services' slots, and the traffic after the upgrade counted
    with PinnedMaps.open(env.pin_dir) as m:
        names = {str(k): v.service for k, v in m.read_state().services.items()}
        assert names == {LB_WHOLE: "default/vm1", LB_FILT: "default/vm2"}
        counted = {c.service: c for c in m.service_counters()}
    assert counted["default/vm1"].in_packets > 0 and counted["default/vm1"].out_packets > 0
    assert counted["default/vm2"].in_packets > 0 and counted["default/vm2"].out_packets > 0
    env.set_services(WHOLE)


def test_layout_3_is_upgraded_in_place_without_a_lost_packet(
    env: AgentLab, tmp_path: Path, repo_root: Path
) -> None:
    """Layout 4 adds the source ranges and the flows' timeouts beside the maps of layout 3,
    which are kept (flows too: their values gained the closing mark in a bit layout 3 never
    set)."""
    old = layout_tree(repo_root, tmp_path / "layout3", 3)
    traffic = upgrade_under_traffic(env, old, "svcstats")
    assert env.layout_version() == LAYOUT_VERSION, env.log()[-3000:]
    assert env.map_ids()["flow4"] == traffic.old_maps["flow4"], "the flows are kept"
    traffic.check()
    with PinnedMaps.open(env.pin_dir) as m:
        assert m.flow_timeouts()["udp"] == 120
    env.set_services(WHOLE)


def test_layout_4_is_upgraded_in_place_without_a_lost_packet(
    env: AgentLab, tmp_path: Path, repo_root: Path
) -> None:
    """Layout 5 adds the fast paths' seen slots beside the maps of layout 4, which are kept as
    they are: the flows the old programs recorded still admit their replies."""
    old = layout_tree(repo_root, tmp_path / "layout4", 4)
    traffic = upgrade_under_traffic(env, old, "flowcfg")
    assert env.layout_version() == LAYOUT_VERSION, env.log()[-3000:]
    new = env.map_ids()
    assert set(new) - set(traffic.old_maps) == {
        "seen4",
        "seen6",
        "addrhint",
        "rolehint",
        "tail_rare",
        "limits",
        "buckets",
    }, "created beside"
    kept = {k: v for k, v in traffic.old_maps.items() if k != "svcstats"}  # layout 6: copied
    assert {k: new[k] for k in kept} == kept, "every other map kept as it is"
    assert new["svcstats"] != traffic.old_maps["svcstats"]
    traffic.check()
    env.set_services(WHOLE)


def test_layout_5_is_upgraded_in_place_without_a_lost_packet(
    env: AgentLab, tmp_path: Path, repo_root: Path
) -> None:
    """Layout 6 gives the per-Service counters room for drop_spoofed: svcstats is a new map with
    the old counters copied into it (zero-padded), every other map is kept as it is, and the
    programs count into the new one."""
    old = layout_tree(repo_root, tmp_path / "layout5", 5)
    traffic = upgrade_under_traffic(env, old, "seen4")
    assert env.layout_version() == LAYOUT_VERSION, env.log()[-3000:]
    new = env.map_ids()
    assert set(new) - set(traffic.old_maps) == {
        "addrhint",
        "rolehint",
        "tail_rare",
        "limits",
        "buckets",
    }, "created beside the others"
    assert {k: new[k] for k in traffic.old_maps if k != "svcstats"} == {
        k: v for k, v in traffic.old_maps.items() if k != "svcstats"
    }, "every map but svcstats kept as it is"
    assert new["svcstats"] != traffic.old_maps["svcstats"], "svcstats replaced"
    assert "svcstats (value size 96 (want 160), values zero-padded)" in env.log()
    assert "rebuilt map" not in env.log()
    traffic.check()
    with PinnedMaps.open(env.pin_dir) as m:
        counted = {c.service: c for c in m.service_counters()}
    # the new programs count into the new map: traffic after the switch
    assert counted["default/vm1"].in_packets > 0 and counted["default/vm2"].out_packets > 0
    env.set_services(WHOLE)


# -- a prog array of another layout (issue 45, item 7) -----------------------------------------

TAIL_ARRAYS = ("tail_xdp", "tail_tc", "tail_rare")


def wider_tail_tree(repo: Path, dest: Path) -> Path:
    """This tree's package and programs with prog arrays of 8 slots where this layout has 4:
    an agent whose prog arrays have another layout than this one's, so that this tree's agent
    replaces them (pins.ensure_pins: another size)."""
    for part in ("cozyebpf", "bpf"):
        shutil.copytree(repo / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    lay = dest / "cozyebpf/datapath/layout.py"
    text = lay.read_text()
    for name in TAIL_ARRAYS:
        old = f'"{name}", bpfsys.BPF_MAP_TYPE_PROG_ARRAY, _u32, _u32, "__u32", "__u32", 4,'
        assert old in text, name
        text = text.replace(old, old.replace(" 4,", " 8,"))
    lay.write_text(text)
    tail = dest / "bpf/lib/tail.h"
    text = tail.read_text()
    for name in TAIL_ARRAYS:
        old = f"cz_{name}, 4, "
        assert old in text, name
        text = text.replace(old, f"cz_{name}, 8, ")
    tail.write_text(text)
    return dest


def tail_size(env: AgentLab, name: str) -> int:
    fd = bpfsys.obj_get(f"{env.pin_dir}/{name}")
    try:
        return bpfsys.map_info(fd).max_entries
    finally:
        os.close(fd)


def compiler_child(agent_pid: int) -> int | None:
    """The pid of the agent's compiler child (cozyebpf.datapath.compiler), if it runs."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == agent_pid and b"cozyebpf.datapath.compiler" in cmdline:
            return int(entry)
    return None


def arp_answered(env: AgentLab) -> bool:
    """The client asks who has the node's uplink address (a frame each entry program hands to
    its full path): is it answered?"""
    from scapy.layers.l2 import ARP, Ether

    from cozylab.netns import CLIENT_MAC, NODE_UPLINK_IP

    ask = Ether(src=CLIENT_MAC, dst="ff:ff:ff:ff:ff:ff") / ARP(
        op=1, hwsrc=CLIENT_MAC, psrc=CLIENT_IP, pdst=NODE_UPLINK_IP
    )
    sock = env.packet_socket(env.lab.client, "eth0")
    drain(sock)
    for _ in range(3):
        sock.send(bytes(ask))
        deadline = time.monotonic() + 0.5  # (other frames keep coming: the stream's)
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(65535)
            except TimeoutError:
                break
            e = Ether(data)
            if ARP in e and e[ARP].op == 2 and e[ARP].psrc == NODE_UPLINK_IP:
                return True
    return False


def pinged(env: AgentLab, addr: str) -> bool:
    """ICMP echo from the client to `addr` answered (ICMP is the full paths' frame)."""
    p = env.lab.exec(env.lab.client, "ping", "-c", "2", "-i", "0.2", "-W", "1", addr, check=False)
    return p.returncode == 0


def test_a_prog_array_of_another_layout_keeps_its_programs_until_the_new_ones_attach(
    env: AgentLab, tmp_path: Path, repo_root: Path
) -> None:
    """An upgrade that changes the prog arrays' layout (another size) under traffic: this
    tree's agent replaces the pinned arrays before its programs are compiled; the old entry
    programs, still attached, go on handing frames to their full and rare paths through the old
    arrays, which stay pinned (under retired/) until the new programs are attached. The compiler
    is held stopped (SIGSTOP) between the two, a compile window as long as the test wants: in
    it, ARP is answered, ICMP to a whole-IP LB IP (a full-path frame both ways) is answered, and
    a UDP stream to that LB IP loses nothing. Before, the old arrays were unpinned at once and
    emptied themselves: every frame handed to a full path was dropped (missed tail call) for
    the whole window, ARP included. After the attach the old arrays are gone."""
    lab = env.lab
    old = wider_tail_tree(repo_root, tmp_path / "wider")
    new_cmd = env.cmd
    env.cmd = [sys.executable, "-m", "cozyebpf"]
    env.env.update(PYTHONPATH=str(old), PYTHONSAFEPATH="1")
    env.start_agent()
    wait_for(lambda: "now 2 services, 2 pods" in env.log(), 10, "the old agent's sync")
    assert {n: tail_size(env, n) for n in TAIL_ARRAYS} == dict.fromkeys(TAIL_ARRAYS, 8)
    assert arp_answered(env) and pinged(env, LB_WHOLE), "the old agent's programs answer"
    stream = UdpStream(lab, lab.client, (LB_WHOLE, 9100), (lab.pod_ns(POD1), 9100), 1000)
    stream.start()
    try:
        flowing([stream], udp=300, tcp=0, other=0)
        assert env.stop_agent(signal.SIGTERM) == 0
        del env.env["PYTHONPATH"], env.env["PYTHONSAFEPATH"]
        env.cmd = new_cmd
        offset = len(env.log())
        starting = threading.Thread(target=env.start_agent)
        starting.start()
        held = None
        try:
            # prepare() replaced the arrays; hold the compiler before anything is attached
            wait_for(
                lambda: f"{env.pin_dir}/tail_tc" in env.log()[offset:] and env.proc is not None,
                hang_bound(60),
                "the new agent's prepare",
            )
            assert env.proc is not None
            held = wait_for(lambda: compiler_child(env.proc.pid), hang_bound(60), "the compiler")
            os.kill(held, signal.SIGSTOP)
            assert "datapath ready" not in env.log()[offset:], "held before the attach"
            assert {n: tail_size(env, n) for n in TAIL_ARRAYS} == dict.fromkeys(TAIL_ARRAYS, 4)
            before = len(stream.sent)
            # the compile window: the old entry programs and their arrays
            # (before issue 45's fix: both dropped, the old entries' tail calls missed)
            answered = {"ARP": arp_answered(env), "ICMP to the LB IP": pinged(env, LB_WHOLE)}
            assert answered == {"ARP": True, "ICMP to the LB IP": True}, "in the compile window"
            flowing([stream], udp=300, tcp=0, other=0)
            assert len(stream.sent) - before >= 300
        finally:
            if held is not None:
                os.kill(held, signal.SIGCONT)
            starting.join()
        assert "datapath ready" in env.log()[offset:], env.log()[offset:][-3000:]
        assert not os.path.exists(f"{env.pin_dir}/retired"), "the old arrays unpinned"
        assert arp_answered(env) and pinged(env, LB_WHOLE)
        flowing([stream], udp=300, tcp=0, other=0)
    finally:
        stream.stop()
    assert len(stream.sent) > 900 and stream.lost() == [], f"{len(stream.lost())} lost"
    env.set_services(WHOLE)
