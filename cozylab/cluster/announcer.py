"""MetalLB L2's stand-in: the election (`elect`) and a speaker per node (`Speaker`) that answers
ARP for the LB IPs its node announces and sends gratuitous ARP when it starts announcing one."""

from __future__ import annotations

import contextlib
import hashlib
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence

from cozylab.cluster.spec import node_name
from cozylab.netns import PACKET_OUTGOING, Lab

ETH_P_ARP = 0x0806


def elect(ip: str, nodes: Sequence[int]) -> int | None:
    """MetalLB L2's choice among the nodes with a ready endpoint (externalTrafficPolicy
    Local): the lowest sha256(node name + "#" + ip)."""
    if not nodes:
        return None
    return min(nodes, key=lambda n: hashlib.sha256(f"{node_name(n)}#{ip}".encode()).digest())


def _arp(op: int, sha: bytes, spa: str, tha: bytes, tpa: str, dst: bytes) -> bytes:
    return (
        dst
        + sha
        + struct.pack("!H", ETH_P_ARP)
        + struct.pack("!HHBBH", 1, 0x0800, 6, 4, op)
        + sha
        + socket.inet_aton(spa)
        + tha
        + socket.inet_aton(tpa)
    )


def _mac(text: str) -> bytes:
    return bytes.fromhex(text.replace(":", ""))


class Speaker:
    """A MetalLB L2 speaker on a node's eth0: answers ARP for the LB IPs it announces and
    sends a gratuitous ARP (request and reply) for each IP it starts announcing."""

    def __init__(self, lab: Lab, ns: str, dev: str, mac: str) -> None:
        self.mac = _mac(mac)
        self.sock = lab.ns_socket(ns, socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ARP))
        self.sock.bind((dev, ETH_P_ARP))
        self.announced: set[str] = set()
        self.garps: list[tuple[float, str]] = []  # (time.monotonic(), ip)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"speaker-{ns}", daemon=True)
        self._thread.start()

    def announce(self, ips: set[str]) -> None:
        with self._lock:
            new = ips - self.announced
            self.announced = set(ips)
        bcast = b"\xff" * 6
        for ip in sorted(new):
            for op in (1, 2):
                self.sock.send(_arp(op, self.mac, ip, bcast, ip, bcast))
            self.garps.append((time.monotonic(), ip))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.1)
                if not ready:
                    continue
                frame, addr = self.sock.recvfrom(2048)
            except (OSError, ValueError):
                return
            if addr[2] == PACKET_OUTGOING or len(frame) < 42:
                continue
            op = struct.unpack("!H", frame[20:22])[0]
            sha, spa, tpa = frame[22:28], frame[28:32], socket.inet_ntoa(frame[38:42])
            with self._lock:
                ours = tpa in self.announced
            if op == 1 and ours:
                with contextlib.suppress(OSError):
                    self.sock.send(_arp(2, self.mac, tpa, sha, socket.inet_ntoa(spa), sha))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
