"""Traffic that runs while the agent changes (restarts, kill, upgrade): sequence-numbered UDP
streams and long-lived TCP chats that count what was lost."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cozylab.netns import Lab, wait_for


@dataclass
class UdpStream:
    """Sequence-numbered datagrams from one namespace to another, ~1000 per second."""

    lab: Lab
    src_ns: str
    dst_ns: str
    dst: tuple[str, int]
    listen_port: int
    sent: int = 0
    received: set[int] = field(default_factory=set)
    peers: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        rx = self.lab.ns_socket(self.dst_ns, socket.AF_INET, socket.SOCK_DGRAM)
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        rx.bind(("0.0.0.0", self.listen_port))
        rx.settimeout(0.2)
        tx = self.lab.ns_socket(self.src_ns, socket.AF_INET, socket.SOCK_DGRAM)

        def receive() -> None:
            while not (self._stop.is_set() and self._drained()):
                with contextlib.suppress(TimeoutError):
                    data, peer = rx.recvfrom(64)
                    self.received.add(int.from_bytes(data[:8], "big"))
                    self.peers.add(peer[0])
            rx.close()

        def send() -> None:
            while not self._stop.is_set():
                tx.sendto(self.sent.to_bytes(8, "big"), self.dst)
                self.sent += 1
                time.sleep(0.001)
            tx.close()

        self._threads = [
            threading.Thread(target=receive, daemon=True),
            threading.Thread(target=send, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _drained(self) -> bool:
        return len(self.received) >= self.sent or time.monotonic() > self._deadline

    def stop(self) -> None:
        self._deadline = time.monotonic() + 2
        self._stop.set()
        for t in self._threads:
            t.join(5)

    def lost(self) -> list[int]:
        return sorted(set(range(self.sent)) - self.received)


@dataclass
class TcpChat:
    """One long-lived TCP connection: a line every 20 ms, each echoed back."""

    lab: Lab
    ns: str
    dst: tuple[str, int]
    rounds: int = 0
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        sock = self.lab.ns_socket(self.ns, socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(self.dst)

        def chat() -> None:
            try:
                while not self._stop.is_set():
                    msg = f"{self.rounds}\n".encode()
                    sock.sendall(msg)
                    got = b""
                    while not got.endswith(b"\n"):
                        chunk = sock.recv(64)
                        if not chunk:
                            raise ConnectionError("closed by the peer")
                        got += chunk
                    assert got == msg, (got, msg)
                    self.rounds += 1
                    time.sleep(0.02)
            except BaseException as e:
                self.error = e
            finally:
                sock.close()

        self._thread = threading.Thread(target=chat, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)


def line_echo(s: socket.socket) -> None:
    """Accept one connection and echo it line by line until it closes."""
    conn, _ = s.accept()
    with conn:
        conn.settimeout(30)
        while data := conn.recv(4096):
            conn.sendall(data)


def progress(stream: Any) -> int:
    """How far a stream got: datagrams received (UdpStream), rounds (TcpChat), answered
    requests (anything with `answered`)."""
    if isinstance(stream, UdpStream):
        return len(stream.received)
    if isinstance(stream, TcpChat):
        return stream.rounds
    return int(stream.answered)


def flowing(
    streams: Sequence[Any], udp: int, tcp: int, other: int = 0, timeout: float = 30
) -> None:
    """Wait until every stream has moved on by that much from now (UDP datagrams received, TCP
    rounds, other streams' answers): traffic passes in this phase, however slow the machine."""
    step = {UdpStream: udp, TcpChat: tcp}
    need = {id(s): progress(s) + step.get(type(s), other) for s in streams}

    def state(s: Any) -> str:
        error = getattr(s, "error", None)
        return f"{s.dst} at {progress(s)}/{need[id(s)]}" + (f" ({error!r})" if error else "")

    wait_for(
        lambda: all(progress(s) >= need[id(s)] for s in streams),
        timeout,
        lambda: "traffic: " + ", ".join(state(s) for s in streams),
    )
