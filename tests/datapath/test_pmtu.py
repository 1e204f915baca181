"""Path MTU discovery through the NAT: the pod sends large DF segments, a hop on the client's
side answers "fragmentation needed, MTU 1280" to the LB IP; the pod must receive an error whose
inner header names its own address, lower its route's MTU, and send segments that fit. With
cozy-proxy's outer-only NAT the inner header would still name the LB IP and the pod would ignore
the error (a PMTU black hole)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from scapy.layers.inet import ICMP, IP, TCP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP, CLIENT_MAC, DEFAULT_PODS, UPLINK_MAC, Lab, capture, drain
from tests.support.labtools import AgentLab, agent_lab, wait_for
from tests.support.packets import LB_FILT, LB_WHOLE

POD1, POD2 = DEFAULT_PODS[:2]
WHOLE = Svc("vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc("vm2", LB_FILT, POD2.ip, [("TCP", 80)])  # no allowICMP: the error must be "related"


@pytest.fixture
def env(tmp_path: Path, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("u", tmp_path, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(WHOLE, FILT)) as env:
        for pod in (POD1, POD2):  # real segments, not GSO super-packets, on the wire
            env.lab.exec(env.lab.pod_ns(pod), "ethtool", "-K", "eth0", "tso", "off", "gso", "off")
        env.start_agent()
        env.set_services(WHOLE, FILT)
        yield env


def sink(lab: Lab, port: int) -> socket.socket:
    s = lab.ns_socket(lab.client, socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((CLIENT_IP, port))
    s.listen(1)

    def drain_all() -> None:
        conn, _ = s.accept()
        with conn:
            while conn.recv(65536):
                pass

    threading.Thread(target=drain_all, daemon=True).start()
    return s


def capture_until(rx: socket.socket, done: Callable[[list[bytes]], bool]) -> list[bytes]:
    """Frames on `rx` (both directions) until `done` says they are enough, or 10 s passed."""
    frames: list[bytes] = []
    deadline = time.monotonic() + 10
    while not done(frames) and time.monotonic() < deadline:
        frames += capture(rx, 0.2, incoming_only=False)
    return frames


def data_from(lb: str, frame: bytes) -> bytes:
    """The TCP payload of a segment from `lb`, else b""."""
    p = Ether(frame)
    return bytes(p[TCP].payload) if TCP in p and IP in p and p[IP].src == lb else b""


def big_from(lb: str, frame: bytes) -> bool:
    p = Ether(frame)
    return TCP in p and IP in p and p[IP].src == lb and len(p[IP]) > 1280


@pytest.mark.parametrize(
    ("pod", "lb"), [(POD1, LB_WHOLE), (POD2, LB_FILT)], ids=["whole-ip", "port-filter"]
)
def test_fragmentation_needed_reaches_the_pod(env: AgentLab, pod: object, lb: str) -> None:
    from cozylab.netns import Pod

    assert isinstance(pod, Pod)
    lab = env.lab
    pod_ns = lab.pod_ns(pod)
    rx = env.packet_socket(lab.node, "uplink")  # what leaves the node, after our egress
    tx = env.packet_socket(lab.client, "eth0")
    server = sink(lab, 9300)
    c = lab.ns_socket(pod_ns, socket.AF_INET, socket.SOCK_STREAM)
    try:
        c.connect((CLIENT_IP, 9300))  # MSS 1460 agreed
        # from now on the client's link takes 1280 bytes: larger frames are lost on the way, as
        # behind a router with a smaller MTU, so they stay unacknowledged
        lab.ip(lab.client, "link", "set", "eth0", "mtu", "1280")
        drain(rx)
        c.sendall(b"x" * 4000)
        frames = capture_until(rx, lambda fs: any(big_from(lb, f) for f in fs))
        big = [f for f in frames if big_from(lb, f)]
        assert big, f"full-size segments from the LB IP: {[Ether(f).summary() for f in frames]}"
        seg = Ether(big[0])[IP]
        assert seg.flags.DF
        # the hop after the client answers: fragmentation needed, next-hop MTU 1280
        err = (
            Ether(src=CLIENT_MAC, dst=UPLINK_MAC)
            / IP(src=CLIENT_IP, dst=lb)
            / ICMP(type=3, code=4, nexthopmtu=1280)
            / Raw(bytes(seg)[: 28 + 20])
        )
        tx.send(bytes(err))

        def route_mtu() -> str:
            out = lab.exec(pod_ns, "ip", "route", "get", CLIENT_IP).stdout
            return out if "mtu 1280" in out else ""

        assert "mtu 1280" in wait_for(route_mtu, 5, "the pod's route cache to learn 1280")
        drain(rx)
        c.sendall(b"y" * 8000)
        frames = capture_until(rx, lambda fs: sum(data_from(lb, f).count(b"y") for f in fs) >= 8000)
        sizes = [len(Ether(f)[IP]) for f in frames if data_from(lb, f)]
        assert sum(data_from(lb, f).count(b"y") for f in frames) >= 8000, sizes
        assert max(sizes) <= 1280, sizes
    finally:
        c.close()
        server.close()
