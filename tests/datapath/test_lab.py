"""End-to-end datapath tests: a real `cozyebpf run` on the node of a namespace lab, real
packets (scapy-built, compared whole) and real sockets (ping, curl, TCP/UDP clients)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from scapy.layers.inet import ICMP, IP, TCP, UDP
from scapy.layers.l2 import GRE, Ether
from scapy.layers.sctp import SCTP, SCTPChunkData
from scapy.packet import Packet

from cozyebpf.datapath import kernel
from cozylab import netns as labmod
from cozylab.k8s import Svc
from cozylab.netns import CLIENT_IP, CLIENT_MAC, UPLINK_MAC, capture, drain
from tests.support.labtools import (
    AgentLab,
    agent_lab,
    serve,
    tcp_echo,
    tcp_talk,
    udp_echo,
    udp_talk,
    wait_for,
)
from tests.support.packets import LB_FILT, LB_WHOLE, assert_frame, checksums_ok, partial_checksum_ok

POD1, POD2, POD3 = labmod.DEFAULT_PODS  # whole-IP, port-filter, no Service

WHOLE = Svc("vm-whole", LB_WHOLE, POD1.ip, [("TCP", 22)], whole_ip="true")
FILT = Svc("vm-filt", LB_FILT, POD2.ip, [("TCP", 80), ("UDP", 53)])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, cozyebpf_cmd: list[str]) -> Iterator[AgentLab]:
    with agent_lab("l", tmp_path_factory.mktemp("lab"), cozyebpf_cmd) as env:
        env.start_agent()
        yield env
        rc = env.stop_agent()
        assert rc == 0, f"agent exited with {rc}:\n{env.log()[-3000:]}"


@pytest.fixture
def services(env: AgentLab) -> AgentLab:
    env.set_services(WHOLE, FILT)
    return env


def to_pod(pod: labmod.Pod, ip_layer: Packet) -> Packet:
    """What `ip_layer` (sent by the client to an LB IP) must look like at the pod: forwarded by
    the node (MACs of the pod link, TTL - 1) with destination = pod IP, checksums recomputed."""
    want = ip_layer.copy()
    want[IP].dst = pod.ip
    want[IP].ttl -= 1
    del want[IP].chksum
    for layer in (TCP, UDP):
        if layer in want and want[layer].chksum != 0:
            del want[layer].chksum
    return Ether(src=pod.host_mac, dst=pod.mac) / IP(bytes(want))


def from_client(ip_layer: Packet) -> bytes:
    return bytes(Ether(src=CLIENT_MAC, dst=UPLINK_MAC) / ip_layer)


def _ip_match(src: str, dst: str, proto: int, marker: int) -> object:
    def match(frame: bytes) -> bool:
        p = Ether(frame)
        return (
            IP in p
            and p[IP].src == src
            and p[IP].dst == dst
            and p[IP].proto == proto
            and p[IP].id == marker
        )

    return match


SCTP_DATA = SCTP(sport=5000, dport=7777, tag=9) / SCTPChunkData(data=b"sctp-data")

WHOLE_IP_CASES = [
    (
        "tcp-unlisted-port",
        IP(src=CLIENT_IP, dst=LB_WHOLE, id=101, ttl=64)
        / TCP(sport=40100, dport=4444, flags="S", seq=1000),
    ),
    (
        "udp-unlisted-port",
        IP(src=CLIENT_IP, dst=LB_WHOLE, id=102, ttl=64)
        / UDP(sport=40100, dport=9999)
        / b"whole udp",
    ),
    (
        "udp-checksum-0",
        IP(src=CLIENT_IP, dst=LB_WHOLE, id=103, ttl=64)
        / UDP(sport=40100, dport=9999, chksum=0)
        / b"no checksum",
    ),
    ("icmp-echo", IP(src=CLIENT_IP, dst=LB_WHOLE, id=104, ttl=64) / ICMP(id=77, seq=1) / b"ping"),
    ("sctp", IP(src=CLIENT_IP, dst=LB_WHOLE, id=105, ttl=64) / SCTP_DATA),
    (
        "gre",
        IP(src=CLIENT_IP, dst=LB_WHOLE, id=106, ttl=64)
        / GRE()
        / IP(src="192.0.2.1", dst="192.0.2.2")
        / UDP(dport=1),
    ),
]


@pytest.mark.parametrize("pkt", [c[1] for c in WHOLE_IP_CASES], ids=[c[0] for c in WHOLE_IP_CASES])
def test_whole_ip_every_protocol_reaches_the_pod(services: AgentLab, pkt: Packet) -> None:
    got = services.send_and_capture(
        from_client(pkt), POD1, _ip_match(CLIENT_IP, POD1.ip, pkt[IP].proto, pkt[IP].id)
    )
    assert len(got) == 1, f"expected one frame at {POD1.name}, got {len(got)}"
    assert_frame(got[0], to_pod(POD1, pkt), "frame at the pod")
    assert checksums_ok(got[0]) == []


def test_whole_ip_replies_come_from_the_lb_ip(services: AgentLab) -> None:
    lab = services.lab
    # ICMP with the real ping
    out = lab.exec(lab.client, "ping", "-c", "2", "-W", "2", LB_WHOLE).stdout
    assert f"from {LB_WHOLE}" in out and " 0% packet loss" in out
    # UDP to a port that is not in spec.ports
    with serve(lab, lab.pod_ns(POD1), socket.SOCK_DGRAM, 9999, udp_echo):
        data, peer = udp_talk(lab, lab.client, LB_WHOLE, 9999, b"hi")
    assert peer == (LB_WHOLE, 9999)
    assert data == f"{CLIENT_IP} hi".encode()  # the pod saw the client's real address
    # TCP to a port that is not in spec.ports
    with serve(lab, lab.pod_ns(POD1), socket.SOCK_STREAM, 4444, tcp_echo):
        assert tcp_talk(lab, lab.client, LB_WHOLE, 4444, b"tcp") == f"{CLIENT_IP} tcp".encode()


@pytest.mark.parametrize("offload", [False, True], ids=["sw-checksum", "tx-offload"])
def test_reply_frames_carry_the_lb_ip_and_valid_checksums(
    services: AgentLab, offload: bool
) -> None:
    """The pod's UDP replies leave with source = LB IP. With tx checksum offload off the pod's
    kernel writes full checksums, which must verify after SNAT; with offload on (the veth
    default) the field holds the pseudo-header sum, which must match the new source."""
    lab = services.lab
    pod_ns = lab.pod_ns(POD1)
    lab.exec(pod_ns, "ethtool", "-K", "eth0", "tx", "on" if offload else "off")
    rx = services.packet_socket(lab.client, "eth0")
    tx = services.packet_socket(lab.client, "eth0")
    try:
        with serve(lab, pod_ns, socket.SOCK_DGRAM, 9998, udp_echo):
            drain(rx)
            tx.send(
                from_client(IP(src=CLIENT_IP, dst=LB_WHOLE) / UDP(sport=41000, dport=9998) / b"x")
            )
            replies = [
                f for f in capture(rx, 1.0) if UDP in Ether(f) and Ether(f)[UDP].sport == 9998
            ]
    finally:
        lab.exec(pod_ns, "ethtool", "-K", "eth0", "tx", "on")
    assert len(replies) == 1
    r = Ether(replies[0])
    assert (r[IP].src, r[IP].dst, r[UDP].dport) == (LB_WHOLE, CLIENT_IP, 41000)
    if offload:
        assert not [b for b in checksums_ok(replies[0]) if b.startswith("ip")]
        assert partial_checksum_ok(replies[0])
    else:
        assert r[UDP].chksum != 0 and checksums_ok(replies[0]) == []


@pytest.mark.parametrize("pod,lb", [(POD1, LB_WHOLE), (POD2, LB_FILT)], ids=["whole", "filter"])
def test_pod_egress_is_seen_as_the_lb_ip(services: AgentLab, pod: labmod.Pod, lb: str) -> None:
    """The pod's own connections leave with source = LB IP, and their replies come back, also
    in port-filter mode (the flow table lets them in)."""
    lab = services.lab
    with serve(lab, lab.client, socket.SOCK_STREAM, 8443, tcp_echo):
        assert tcp_talk(lab, lab.pod_ns(pod), CLIENT_IP, 8443, b"out") == f"{lb} out".encode()
    with serve(lab, lab.client, socket.SOCK_DGRAM, 5353, udp_echo):
        assert udp_talk(lab, lab.pod_ns(pod), CLIENT_IP, 5353, b"dns?") == (
            f"{lb} dns?".encode(),
            (CLIENT_IP, 5353),
        )
    out = lab.exec(lab.pod_ns(pod), "ping", "-c", "1", "-W", "2", CLIENT_IP).stdout
    assert " 0% packet loss" in out


def test_port_filter(services: AgentLab) -> None:
    lab = services.lab
    pod2 = lab.pod_ns(POD2)
    before = services.counters()
    with (
        serve(lab, pod2, socket.SOCK_STREAM, 80, tcp_echo),
        serve(lab, pod2, socket.SOCK_STREAM, 81, tcp_echo),
    ):
        assert tcp_talk(lab, lab.client, LB_FILT, 80, b"ok") == f"{CLIENT_IP} ok".encode()
        with pytest.raises(TimeoutError):  # the pod listens, but 81 is not in spec.ports
            tcp_talk(lab, lab.client, LB_FILT, 81, b"no", timeout=1)
    ping = lab.exec(lab.client, "ping", "-c", "1", "-W", "1", LB_FILT, check=False)
    assert ping.returncode != 0
    after = services.counters()
    assert after["drop_port"] > before["drop_port"]
    assert after["drop_icmp"] == before["drop_icmp"] + 1
    assert after["pass_port"] > before["pass_port"]


def test_a_listed_port_of_another_protocol_is_dropped(services: AgentLab) -> None:
    pkt = IP(src=CLIENT_IP, dst=LB_FILT, id=201) / UDP(sport=40200, dport=80) / b"udp80"
    assert (
        services.send_and_capture(from_client(pkt), POD2, _ip_match(CLIENT_IP, POD2.ip, 17, 201))
        == []
    )
    pkt = IP(src=CLIENT_IP, dst=LB_FILT, id=202) / UDP(sport=40200, dport=53) / b"udp53"
    got = services.send_and_capture(from_client(pkt), POD2, _ip_match(CLIENT_IP, POD2.ip, 17, 202))
    assert len(got) == 1
    assert_frame(got[0], to_pod(POD2, pkt), "listed UDP port")


def test_toggling_allow_icmp_and_whole_ip_needs_no_restart(services: AgentLab) -> None:
    lab = services.lab
    pid = services.proc.pid if services.proc else None
    ping = ["ping", "-c", "1", "-W", "1", LB_FILT]
    assert lab.exec(lab.client, *ping, check=False).returncode != 0
    services.set_services(WHOLE, Svc(**{**FILT.__dict__, "allow_icmp": "true"}))
    assert " 0% packet loss" in lab.exec(lab.client, *ping).stdout
    services.set_services(WHOLE, Svc(**{**FILT.__dict__, "allow_icmp": "false"}))
    assert lab.exec(lab.client, *ping, check=False).returncode != 0
    # whole-IP opens every port
    with serve(lab, lab.pod_ns(POD2), socket.SOCK_STREAM, 81, tcp_echo):
        services.set_services(WHOLE, Svc(**{**FILT.__dict__, "whole_ip": "true"}))
        assert tcp_talk(lab, lab.client, LB_FILT, 81, b"all") == f"{CLIENT_IP} all".encode()
    services.set_services(WHOLE, FILT)
    assert services.proc is not None and services.proc.pid == pid  # same agent all along


def test_removing_a_service_removes_its_nat_only(services: AgentLab) -> None:
    lab = services.lab
    services.set_services(WHOLE)
    st = services.maps_state()
    assert set(map(str, st.services)) == {LB_WHOLE}
    assert set(map(str, st.pods)) == {POD1.ip}
    assert {str(a.pod_ip) for a in st.allowed} == set()
    pkt = IP(src=CLIENT_IP, dst=LB_FILT, id=301) / TCP(sport=40300, dport=80, flags="S")
    assert (
        services.send_and_capture(
            from_client(pkt), POD2, lambda f: IP in Ether(f) and Ether(f)[IP].id == 301
        )
        == []
    )
    assert " 0% packet loss" in lab.exec(lab.client, "ping", "-c", "1", "-W", "2", LB_WHOLE).stdout
    # and the pod's egress is no longer rewritten
    with serve(lab, lab.client, socket.SOCK_STREAM, 8444, tcp_echo):
        assert tcp_talk(lab, lab.pod_ns(POD2), CLIENT_IP, 8444, b"x") == f"{POD2.ip} x".encode()


def test_curl_through_the_lb_ip(services: AgentLab, tmp_path: Path) -> None:
    lab = services.lab
    (tmp_path / "index.html").write_text("served by pod1\n")
    srv = lab.popen(
        lab.pod_ns(POD1),
        "python3",
        "-m",
        "http.server",
        "8080",
        "--bind",
        "0.0.0.0",
        "--directory",
        str(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def fetch() -> str:
            p = lab.exec(
                lab.client, "curl", "-sS", "-m", "2", f"http://{LB_WHOLE}:8080/", check=False
            )
            return p.stdout if p.returncode == 0 else ""

        assert wait_for(fetch, 10, "curl through the LB IP") == "served by pod1\n"
    finally:
        srv.send_signal(signal.SIGTERM)
        srv.wait(5)


def test_pod_to_pod_and_pods_without_service_are_untouched(services: AgentLab) -> None:
    lab = services.lab
    with serve(lab, lab.pod_ns(POD2), socket.SOCK_STREAM, 9000, tcp_echo):
        # not a listed port: in-cluster traffic is neither filtered nor translated
        answer = tcp_talk(lab, lab.pod_ns(POD1), POD2.ip, 9000, b"east-west")
        assert answer == f"{POD1.ip} east-west".encode()
    with serve(lab, lab.client, socket.SOCK_STREAM, 8445, tcp_echo):
        assert (
            tcp_talk(lab, lab.pod_ns(POD3), CLIENT_IP, 8445, b"plain")
            == f"{POD3.ip} plain".encode()
        )


def test_maps_dump_reads_the_pins_from_another_process(
    services: AgentLab, cozyebpf_cmd: list[str]
) -> None:
    import json

    lab = services.lab
    p = lab.exec(lab.node, *cozyebpf_cmd, "maps", "dump", "--json", "--pin-dir", services.pin_dir)
    d = json.loads(p.stdout)
    assert [
        (s["lb_ip"], s["pod_ip"], s["mode"], s["allow_icmp"], s["allowed_ports"])
        for s in d["services"]
    ] == [
        (LB_WHOLE, POD1.ip, "whole-ip", False, []),
        (LB_FILT, POD2.ip, "port-filter", False, ["tcp/80", "udp/53"]),
    ]
    # tcx from 6.6, a legacy clsact filter before (Debian 12's 6.1: the Vagrant VM found it)
    has_tcx = kernel.version(os.uname().release) >= kernel.TCX
    assert {(a["device"], a["hook"], a["program"]) for a in d["attachments"]} == {
        ("uplink", "xdp", "cz_ingress"),
        ("uplink", "tcx-egress" if has_tcx else "tc-egress", "cz_egress"),
    }
    assert d["counters"]["nat_ingress"]["packets"] > 0
    table = lab.exec(lab.node, *cozyebpf_cmd, "maps", "dump", "--pin-dir", services.pin_dir).stdout
    row = "203.0.113.20  10.244.1.20  default/vm-filt   port-filter  no    tcp/80,udp/53"
    assert row in table, table
