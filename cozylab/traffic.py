"""Traffic that runs while something changes (an agent restarts, is killed or upgraded, a VM
migrates): the one set of streams the cluster lab (cozylab/cluster) and the datapath tests use.

- `TcpChat`: a long-lived TCP connection, a numbered line at a time, each read back.
- `UdpStream`: numbered datagrams at a fixed rate, one way (a receiver of its own) or echoed.
- `NewFlows`: UDP requests each from a new socket (a new flow each), each awaiting its echo.
- `Download`: a connection read without ever writing to it (only the TCP stack answers).
- the servers: `EchoHub` (every echo socket of a lab in one thread, answering with the address
  it saw), `Pusher` (sends without pause to whoever connects), `line_echo` (a handler for
  tests/support/labtools.serve that echoes lines as they are).
- `flowing`: wait until every stream moved on by so much from now.

Every stream records monotonic times, so a caller can ask what happened after an instant or
how long the longest pause was; errors are kept as text (`describe`), never raised from a
thread."""

from __future__ import annotations

import contextlib
import itertools
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from cozylab.netns import Lab, wait_for


def describe(e: BaseException) -> str:
    """An error of a socket as a row or an assertion says it."""
    if isinstance(e, ConnectionResetError):
        return "connection reset"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | socket.timeout):
        return "timeout"
    return f"{type(e).__name__}: {e}"


def _longest_gap(times: Sequence[float]) -> float:
    return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def tcp_state(sock: socket.socket) -> tuple[float, int]:
    """(the retransmission timeout in seconds, the retransmissions so far) of a connected TCP
    socket, as the kernel keeps them (struct tcp_info: tcpi_rto in microseconds at offset 8,
    tcpi_total_retrans at offset 100)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    (rto,) = struct.unpack_from("=I", info, 8)
    (total_retrans,) = struct.unpack_from("=I", info, 100)
    return rto / 1e6, total_retrans


@dataclass
class _Connection:
    """What a TCP stream from `ns` to `dst` shares: it connects within `timeout` at `start`
    (raises OSError when that fails), runs `_run` in a thread, keeps its error as text."""

    lab: Lab
    ns: str
    dst: tuple[str, int]
    timeout: float = 5.0
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Self:
        sock = self.lab.ns_socket(self.ns, socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.dst)
        except OSError:
            sock.close()
            raise
        self._thread = threading.Thread(target=self._run, args=(sock,), daemon=True)
        self._thread.start()
        return self

    def _run(self, sock: socket.socket) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(15)


@dataclass
class TcpChat(_Connection):
    """One long-lived TCP connection from `ns` to `dst`: a numbered line every `interval`,
    each read back before the next (in lockstep), in a thread. A server that echoes the line as
    it is (`line_echo`) and one that puts the address it saw in front ("<peer> <line>",
    `EchoHub`) both do: `echoes` holds (monotonic time, that address or "") per round; an
    answer that is neither is an error. `timeout` is the connect's and each read's."""

    interval: float = 0.02
    echoes: list[tuple[float, str]] = field(default_factory=list)
    #: the connection's retransmission timeout (s) after each round, beside `echoes`
    rtos: list[float] = field(default_factory=list)
    #: the retransmissions this side made, when the thread ended
    retransmissions: int = 0

    @property
    def rounds(self) -> int:
        return len(self.echoes)

    def _run(self, sock: socket.socket) -> None:
        seq = 0
        try:
            while not self._stop.is_set():
                seq += 1
                line = f"{seq}\n".encode()
                sock.sendall(line)
                buf = b""
                while not buf.endswith(b"\n"):
                    data = sock.recv(4096)
                    if not data:
                        raise ConnectionAbortedError("closed by the peer")
                    buf += data
                peer, sep, rest = buf.partition(b" ")
                if buf != line and (not sep or rest != line):
                    raise ValueError(f"the answer to {line!r} was {buf!r}")
                self.echoes.append((time.monotonic(), peer.decode() if sep else ""))
                self.rtos.append(tcp_state(sock)[0])
                self._stop.wait(self.interval)
        except (OSError, ValueError) as e:
            self.error = describe(e)
        finally:
            with contextlib.suppress(OSError):
                self.retransmissions = tcp_state(sock)[1]
            sock.close()

    def longest_pause(self) -> float:
        return _longest_gap([t for t, _ in self.echoes])

    def longest_pause_and_rto(self) -> tuple[float, float]:
        """The longest pause between two rounds and the retransmission timeout the kernel had
        for the connection when it began (a segment lost then is sent again that much later)."""
        pairs = itertools.pairwise(self.echoes)
        gaps = [(b[0] - a[0], rto) for (a, b), rto in zip(pairs, self.rtos, strict=False)]
        return max(gaps, default=(0.0, 0.0))

    def after(self, t: float) -> int:
        """Rounds completed after monotonic time `t`."""
        return sum(1 for e, _ in self.echoes if e > t)


@dataclass
class UdpStream:
    """Numbered datagrams, `rate` per second, from `ns` to `dst`, in a thread. With `listen`
    (namespace, port) a receiver of its own bound there takes them (one way; `peers`: the
    sources it saw); without, the sender's socket reads the echoes from `dst` of a server that
    answers "<peer> <seq>" (`EchoHub`; `peers`: the addresses it saw). `sent` and `got`:
    sequence number -> monotonic time."""

    lab: Lab
    ns: str
    dst: tuple[str, int]
    listen: tuple[str, int] | None = None
    rate: float = 100.0
    #: at `stop`, how long the last datagram has to arrive
    drain: float = 2.0
    sent: dict[int, float] = field(default_factory=dict)
    got: dict[int, float] = field(default_factory=dict)
    peers: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> UdpStream:
        tx = self.lab.ns_socket(self.ns, socket.AF_INET, socket.SOCK_DGRAM)
        rx = tx
        if self.listen is not None:
            rx = self.lab.ns_socket(self.listen[0], socket.AF_INET, socket.SOCK_DGRAM)
            rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            rx.bind(("0.0.0.0", self.listen[1]))
        rx.settimeout(0.2)
        self._threads = [
            threading.Thread(target=self._send, args=(tx,), daemon=True),
            threading.Thread(target=self._recv, args=(rx,), daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def _send(self, tx: socket.socket) -> None:
        t0 = time.monotonic()
        seq = 0
        while not self._stop.is_set():
            seq += 1
            self.sent[seq] = time.monotonic()
            with contextlib.suppress(OSError):
                tx.sendto(f"{seq}".encode(), self.dst)
            self._stop.wait(max(0.0, t0 + seq / self.rate - time.monotonic()))
        if self.listen is not None:  # else the receiver reads (and closes) this socket
            tx.close()

    def _recv(self, rx: socket.socket) -> None:
        while True:
            try:
                data, src = rx.recvfrom(2048)
            except TimeoutError:
                if self._stop.is_set():
                    break
                continue
            except OSError:
                break
            if self.listen is None and src != self.dst:
                continue  # not the echo
            head, _, tail = data.rpartition(b" ")
            with contextlib.suppress(ValueError):
                self.got[int(tail)] = time.monotonic()
                self.peers.add(head.decode() if head else src[0])
        rx.close()

    def stop(self) -> None:
        """Stop sending, give the last datagram `drain` seconds to arrive (the earlier ones,
        on the same path, came before it), stop receiving."""
        self._stop.set()
        self._threads[0].join(5)
        last = max(self.sent, default=0)
        with contextlib.suppress(TimeoutError):
            wait_for(lambda: last in self.got or not last, self.drain, "the last datagram")
        self._threads[1].join(5)

    def lost(self, between: tuple[float, float] | None = None) -> list[int]:
        """The datagrams that did not arrive (sent between the two monotonic times)."""
        return [
            s
            for s, t in sorted(self.sent.items())
            if s not in self.got and (between is None or between[0] <= t <= between[1])
        ]

    def gap(self) -> float:
        """The longest time without a datagram arriving: from the last arrived datagram's
        sending to the next arrived one's, in send time (what a receiver sees as a hole)."""
        return _longest_gap([self.sent[s] for s in sorted(self.got) if s in self.sent])

    def summary(self) -> str:
        lost = self.lost()
        return f"{len(lost)} of {len(self.sent)} lost, longest gap {self.gap() * 1000:.0f} ms"


@dataclass
class NewFlows:
    """From `ns`, one UDP request every few milliseconds, each from a new socket (a new source
    port: a new flow for the port filter), each expecting the echo within a second."""

    lab: Lab
    ns: str
    dst: tuple[str, int]
    sent: int = 0
    answered: int = 0
    lost: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> NewFlows:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lab.ns_socket(self.ns, socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.settimeout(1.0)
                n = self.sent
                self.sent += 1
                s.sendto(n.to_bytes(8, "big"), self.dst)
                try:
                    s.recvfrom(64)
                    self.answered += 1
                except TimeoutError:
                    self.lost.append(n)
            time.sleep(0.003)

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)


@dataclass
class Download(_Connection):
    """A download `ns` opened to `dst` (a `Pusher`): read without ever writing to it, so only
    the TCP stack answers (ACKs), as a VM downloading a file does. `reads`: (monotonic time,
    bytes) of each read. With `stall`, nothing for that long is an error (a lost flow stalls
    for good, as a reset would); without, the download waits. `timeout`: the connect's."""

    stall: float | None = None
    reads: list[tuple[float, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.reads)

    @property
    def answered(self) -> int:
        """KiB received (for `flowing`)."""
        return self.total // 1024

    def _run(self, sock: socket.socket) -> None:
        sock.settimeout(0.5)
        last = time.monotonic()
        with sock:
            while not self._stop.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    if self.stall is not None and time.monotonic() - last > self.stall:
                        self.error = f"nothing for {self.stall:.0f} s"
                        return
                    continue
                except OSError as e:
                    self.error = describe(e)
                    return
                if not data:
                    self.error = "closed by the peer"
                    return
                last = time.monotonic()
                self.reads.append((last, len(data)))

    def bytes_after(self, t: float) -> int:
        return sum(n for at, n in self.reads if at > t)

    def longest_pause(self) -> float:
        return _longest_gap([t for t, _ in self.reads])


class Pusher:
    """A server in `ns` on `port` that sends `chunk` bytes every `every` seconds to each
    connection until it fails or the pusher closes (the far end of a `Download`), in threads.
    A context manager too."""

    def __init__(
        self, lab: Lab, ns: str, port: int, chunk: int = 1000, every: float = 0.01
    ) -> None:
        self.chunk = b"d" * chunk
        self.every = every
        self.sock = lab.ns_socket(ns, socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", port))
        self.sock.listen(16)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, name="pusher", daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._push, args=(conn,), daemon=True).start()

    def _push(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            while not self._stop.is_set():
                try:
                    conn.sendall(self.chunk)
                except OSError:
                    return
                self._stop.wait(self.every)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def __enter__(self) -> Pusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EchoHub:
    """One thread serving every echo socket of a lab (a socket keeps the namespace it was made
    in). TCP: each read is answered with "<peer ip> <data>"; UDP likewise per datagram."""

    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._add: list[tuple[socket.socket, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self.sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._loop, name="echo-hub", daemon=True)
        self._thread.start()

    def serve(self, lab: Lab, ns: str, kind: int, port: int) -> None:
        s = lab.ns_socket(ns, socket.AF_INET, kind)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("0.0.0.0", port))
        if kind == socket.SOCK_STREAM:
            s.listen(64)
        self._register(s, "listen" if kind == socket.SOCK_STREAM else "udp")

    def _register(self, s: socket.socket, what: str) -> None:
        with self._lock:
            self._add.append((s, what))
            self._socks.append(s)
        self._wake_w.send(b"x")

    def _loop(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(0.2):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                try:
                    self._handle(s, key.data)
                except OSError:
                    with contextlib.suppress(KeyError, ValueError):
                        if key.data == "conn":
                            self.sel.unregister(s)
                            s.close()

    def _handle(self, s: socket.socket, what: str) -> None:
        if what == "wake":
            s.recv(4096)
            with self._lock:
                add, self._add = self._add, []
            for sock, w in add:
                self.sel.register(sock, selectors.EVENT_READ, w)
        elif what == "listen":
            conn, _ = s.accept()
            conn.settimeout(2)
            with self._lock:
                self._socks.append(conn)
            self.sel.register(conn, selectors.EVENT_READ, "conn")
        elif what == "conn":
            data = s.recv(65536)
            if not data:
                self.sel.unregister(s)
                s.close()
                return
            s.sendall(f"{s.getpeername()[0]} ".encode() + data)
        elif what == "udp":
            data, peer = s.recvfrom(65536)
            s.sendto(f"{peer[0]} ".encode() + data, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with self._lock:
            socks = list(self._socks)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
        self._wake_r.close()
        self._wake_w.close()
        self.sel.close()


def line_echo(s: socket.socket) -> None:
    """Accept one connection and echo it line by line until it closes (a handler for
    tests/support/labtools.serve)."""
    conn, _ = s.accept()
    with conn:
        conn.settimeout(30)
        while data := conn.recv(4096):
            conn.sendall(data)


def progress(stream: Any) -> int:
    """How far a stream got: datagrams received (UdpStream), rounds (TcpChat), answered
    requests or KiB (anything with `answered`: NewFlows, Download)."""
    if isinstance(stream, UdpStream):
        return len(stream.got)
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
        return f"{s.dst} at {progress(s)}/{need[id(s)]}" + (f" ({error})" if error else "")

    wait_for(
        lambda: all(progress(s) >= need[id(s)] for s in streams),
        timeout,
        lambda: "traffic: " + ", ".join(state(s) for s in streams),
    )
