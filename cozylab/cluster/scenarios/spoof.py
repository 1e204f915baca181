"""Section 10: a pod sends as a VM's pod IP (issue 21). Each attacker sends a TCP SYN, a UDP
datagram and an ICMP echo to the external server with the victim's pod IP as its source; the
server must see none of them as the victim's LB IP or pod IP, except where nothing can stop it
(behind ovn0 without port security: the rows say so)."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from functools import partial
from ipaddress import ip_address
from typing import TYPE_CHECKING

from cozyebpf.explain import build_packet
from cozylab.cluster.rows import Case, Check, Group
from cozylab.cluster.spec import SERVER_IP, SERVER_TCP, SERVER_UDP, node_name
from cozylab.netns import PACKET_OUTGOING, drain

if TYPE_CHECKING:
    from cozylab.cluster.lab import ClusterLab

SCENARIO = "10 spoofing"
#: (attacker, victim): another VM on the victim's node, a plain pod on another node, and a VM
#: without port security (behind ovn0 nothing stops it: the rows say what happens)
SPOOFS = (("vm-e", "vm-a"), ("p3", "vm-a"), ("vm-f", "vm-b"))
SPOOF_KINDS = ("tcp syn", "udp", "icmp echo")
PROTO = {"tcp syn": 6, "udp": 17, "icmp echo": 1}


def sources_with(cap: socket.socket, marker: bytes, seconds: float) -> set[str]:
    """The IPv4 sources of the frames captured on `cap` within `seconds` that carry
    `marker`."""
    out: set[str] = set()
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        ready, _, _ = select.select([cap], [], [], left)
        if not ready:
            break
        frame, addr = cap.recvfrom(65535)
        if addr[2] == PACKET_OUTGOING:
            continue  # the server's own answer
        if frame[12:14] == b"\x08\x00" and marker in frame:
            out.add(socket.inet_ntoa(frame[26:30]))
    return out


def spoof_where(lab: ClusterLab, attacker: str, victim: str, at: dict[str, int]) -> str:
    same = at[attacker] == at[victim]
    where = f"{lab.where(attacker, at)} as {victim}'s pod IP ({'same' if same else 'another'} node)"
    if lab.layout == "kubeovn" and not lab.workloads[attacker].port_security:
        return f"{where}, no port security: leaves as {victim}'s LB IP"
    return where


def spoof(
    lab: ClusterLab, cap: list[socket.socket], attacker: str, victim: str, kind: str
) -> Check:
    """One spoofed packet, watched for on the server's eth0 (`cap[0]`)."""
    v, node = lab.workloads[victim], node_name(lab.location[attacker])
    assert v.lb_ip is not None
    before = lab.agents.counted("drop_spoofed")
    marker = f"cz-spoof {attacker} {kind}".encode()
    port = SERVER_UDP if kind == "udp" else SERVER_TCP
    pkt = build_packet(ip_address(v.ip), ip_address(SERVER_IP), PROTO[kind], 40001, port, marker)
    drain(cap[0])
    raw = lab.lab.ns_socket(
        lab.pod_ns(attacker), socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW
    )
    with raw:
        raw.sendto(pkt, (SERVER_IP, 0))
    seen = sorted(sources_with(cap[0], marker, 1.0))
    bad = [ip for ip in seen if ip in (v.ip, v.lb_ip)]
    after = lab.agents.counted("drop_spoofed")
    spoofed = {n: after[n] - before.get(n, 0) for n in after if after[n] != before.get(n, 0)}
    # per-pod devices: the attacker's node drops it (drop_spoofed); behind ovn0 only the
    # attacker's port security (the lab's OVN) can, and without it the packet leaves as the
    # victim's LB IP: what the agents' warnings are about
    secured = lab.workloads[attacker].port_security
    detail = f"the server saw it from {', '.join(seen) or 'nobody'}; "
    detail += f"drop_spoofed by node: {spoofed or 'none'}"
    if lab.layout == "perpod":
        return not bad and spoofed == {node: 1}, detail
    if secured:
        return not bad and not spoofed, detail + "; the attacker's port security"
    ok = bad == [v.lb_ip] and not spoofed
    return ok, detail + "; behind ovn0 without port security it leaves, as expected"


@contextlib.contextmanager
def _capture(lab: ClusterLab, cap: list[socket.socket]) -> Iterator[None]:
    """A packet socket on the server's eth0 while the rows run."""
    cap.append(lab.lab.packet_socket(lab.server, "eth0"))
    try:
        yield
    finally:
        cap.pop().close()


def group(lab: ClusterLab, at: dict[str, int]) -> Group:
    """A row per (attacker, victim, kind), with one capture on the server for them all."""
    cap: list[socket.socket] = []
    cases = [
        Case(
            SCENARIO, f"{spoof_where(lab, a, v, at)}: {kind}", partial(spoof, lab, cap, a, v, kind)
        )
        for a, v in SPOOFS
        for kind in SPOOF_KINDS
    ]
    return Group(cases, around=partial(_capture, lab, cap))
