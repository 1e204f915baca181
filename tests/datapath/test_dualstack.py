"""IPv6 and dual-stack through the real agent and datapath: each LB IP goes to the pod IP of
its family, the port filter and allowICMP work for IPv6, the pod's IPv6 egress leaves as the
IPv6 LB IP, and IPv6 frames arrive at the pod translated byte for byte."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from scapy.layers.inet import TCP, UDP
from scapy.layers.inet6 import IPv6, IPv6ExtHdrDestOpt, IPv6ExtHdrHopByHop
from scapy.layers.l2 import Ether
from scapy.packet import Packet

from cozylab.k8s import Svc, manifest
from cozylab.netns import CLIENT_IP6, CLIENT_MAC, DEFAULT_PODS, UPLINK_MAC, Lab
from tests.support.labtools import AgentLab, agent_lab, serve, tcp_echo
from tests.support.packets import LB_FILT, LB_WHOLE, assert_frame

POD1, POD2 = DEFAULT_PODS[:2]
LB6_WHOLE, LB6_FILT = "2001:db8:113::10", "2001:db8:113::20"
WHOLE = Svc(
    "vm1", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true", lb_ip6=LB6_WHOLE, pod_ip6=POD1.ip6
)
FILT = Svc("vm2", LB_FILT, POD2.ip, [("TCP", 80)], lb_ip6=LB6_FILT, pod_ip6=POD2.ip6)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    tmp = tmp_path_factory.mktemp("v6")
    with agent_lab("6", tmp, cozyebpf_cmd, DEFAULT_PODS[:2], manifest(WHOLE, FILT)) as env:
        env.start_agent()
        env.set_services(WHOLE, FILT)  # both families of both Services
        yield env


def talk6(lab: Lab, ns: str, addr: str, port: int, data: bytes, timeout: float = 3) -> bytes:
    with lab.ns_socket(ns, socket.AF_INET6, socket.SOCK_STREAM) as c:
        c.settimeout(timeout)
        c.connect((addr, port))
        c.sendall(data)
        return c.recv(1024)


def serve6(lab: Lab, ns: str, port: int):  # type: ignore[no-untyped-def]
    return serve(lab, ns, socket.SOCK_STREAM, port, tcp_echo, family=socket.AF_INET6)


def test_each_lb_ip_goes_to_the_pod_ip_of_its_family(env: AgentLab) -> None:
    st = env.maps_state()
    assert {str(k): str(v.pod_ip) for k, v in st.services.items()} == {
        LB_WHOLE: POD1.ip,
        LB_FILT: POD2.ip,
        LB6_WHOLE: POD1.ip6,
        LB6_FILT: POD2.ip6,
    }
    assert {str(k): str(v.lb_ip) for k, v in st.pods.items()} == {
        POD1.ip: LB_WHOLE,
        POD2.ip: LB_FILT,
        POD1.ip6: LB6_WHOLE,
        POD2.ip6: LB6_FILT,
    }


def test_whole_ip_over_ipv6(env: AgentLab) -> None:
    lab = env.lab
    out = lab.exec(lab.client, "ping", "-6", "-c", "1", "-W", "2", LB6_WHOLE).stdout
    assert f"from {LB6_WHOLE}" in out and " 0% packet loss" in out
    with serve6(lab, lab.pod_ns(POD1), 4444):  # not in spec.ports
        assert talk6(lab, lab.client, LB6_WHOLE, 4444, b"v6") == f"{CLIENT_IP6} v6".encode()


def test_pod_ipv6_egress_leaves_as_the_lb_ip(env: AgentLab) -> None:
    lab = env.lab
    for pod, lb in ((POD1, LB6_WHOLE), (POD2, LB6_FILT)):  # also a reply through the filter
        with serve6(lab, lab.client, 8446):
            assert talk6(lab, lab.pod_ns(pod), CLIENT_IP6, 8446, b"out") == f"{lb} out".encode()


def test_ipv6_port_filter_and_icmpv6(env: AgentLab) -> None:
    lab = env.lab
    with serve6(lab, lab.pod_ns(POD2), 80), serve6(lab, lab.pod_ns(POD2), 81):
        assert talk6(lab, lab.client, LB6_FILT, 80, b"ok") == f"{CLIENT_IP6} ok".encode()
        with pytest.raises(TimeoutError):
            talk6(lab, lab.client, LB6_FILT, 81, b"no", timeout=1)
    ping = ["ping", "-6", "-c", "1", "-W", "1", LB6_FILT]
    assert lab.exec(lab.client, *ping, check=False).returncode != 0
    env.set_services(WHOLE, Svc(**{**FILT.__dict__, "allow_icmp": "true"}))
    try:
        assert " 0% packet loss" in lab.exec(lab.client, *ping).stdout
    finally:
        env.set_services(WHOLE, FILT)


def to_pod6(ip_layer: Packet, pod_ip6: str, mac: str, host_mac: str) -> Packet:
    want = ip_layer.copy()
    want[IPv6].dst = pod_ip6
    want[IPv6].hlim -= 1
    for layer in (TCP, UDP):
        if layer in want:
            del want[layer].chksum
    return Ether(src=host_mac, dst=mac) / IPv6(bytes(want))


@pytest.mark.parametrize(
    "pkt",
    [
        IPv6(src=CLIENT_IP6, dst=LB6_WHOLE, hlim=64) / TCP(sport=40600, dport=4444, flags="S"),
        IPv6(src=CLIENT_IP6, dst=LB6_WHOLE, hlim=64) / UDP(sport=40601, dport=9999) / b"u6",
        IPv6(src=CLIENT_IP6, dst=LB6_WHOLE, hlim=64)
        / IPv6ExtHdrHopByHop()
        / IPv6ExtHdrDestOpt()
        / UDP(sport=40602, dport=9999)
        / b"ext",
    ],
    ids=["tcp", "udp", "extension-headers"],
)
def test_ipv6_frames_arrive_translated_byte_for_byte(env: AgentLab, pkt: Packet) -> None:
    frame = bytes(Ether(src=CLIENT_MAC, dst=UPLINK_MAC) / pkt)
    sport = pkt[TCP].sport if TCP in pkt else pkt[UDP].sport

    def match(f: bytes) -> bool:
        p = Ether(f)
        return IPv6 in p and any(layer in p and p[layer].sport == sport for layer in (TCP, UDP))

    got = env.send_and_capture(frame, POD1, match)
    assert len(got) == 1
    assert_frame(got[0], to_pod6(pkt, POD1.ip6, POD1.mac, POD1.host_mac), "IPv6 at the pod")
