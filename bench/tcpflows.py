"""TCP flows between a lab's namespaces, measured over a window (bench/limits.py's accuracy and
isolation): senders and receivers as threads of this process, what the receivers read and what
their kernel took, the senders' retransmissions and their namespace's retransmission timeouts,
and the CPU time the machine's other jobs took meanwhile."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cozylab.netns import Lab
from cozylab.traffic import tcp_state

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)


class Others:
    """The CPU time the machine's other jobs took between start and `cpus()`, in CPUs: utime +
    stime of every process that is neither a kernel thread nor this process or one of its
    descendants (the agent). /proc/<pid>/stat's times are the scheduler's exact runtime, split
    by ticks; /proc/stat's idle time is not usable here, as its busy time is sampled at the
    tick, and the limits' work runs right after a tick (the buckets' clock), so that the tick
    finds the CPUs idle. A process that ends within the window is missed (its children's times,
    cutime, would count a whole life at once): a lower bound."""

    def __init__(self) -> None:
        self.t0, self.s0 = time.monotonic(), self._snap()

    @staticmethod
    def _snap() -> dict[int, int]:
        info: dict[int, tuple[int, int, int]] = {}  # pid -> (ppid, flags, clock ticks)
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ticks = int(fields[11]) + int(fields[12])  # utime stime
            info[int(pid)] = (int(fields[1]), int(fields[6]), ticks)
        ours = {os.getpid()}
        while True:
            more = {p for p, (pp, _, _) in info.items() if pp in ours and p not in ours}
            if not more:
                break
            ours |= more
        kthread = 0x00200000  # PF_KTHREAD
        return {p: t for p, (_, fl, t) in info.items() if p not in ours and not fl & kthread}

    def cpus(self) -> float:
        s1, el = self._snap(), time.monotonic() - self.t0
        ticks = sum(max(0, t - self.s0.get(p, 0)) for p, t in s1.items())
        return round(ticks / os.sysconf("SC_CLK_TCK") / el, 3) if el > 0 else 0.0


@dataclass
class TcpRun:
    """TCP flows from `src` to `dst` (namespaces): each a sender thread writing 256 KiB at a
    time and a receiver thread reading; the bytes read and the senders' retransmissions are
    sampled at the start and end of the window."""

    lab: Lab
    src: str
    dst: str
    listen_ip: str  # the receivers' address in dst
    connect_ip: str  # the address the senders connect to (an LB IP for ingress)
    flows: int
    pacing_bps: int | None = None
    cc: str = "cubic"  # the senders' congestion control (TCP_CONGESTION)
    port: int = 0
    cpu: int | None = None  # the CPU the senders and receivers run on (None: any)
    got: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _senders: list[socket.socket] = field(default_factory=list)
    _conns: list[socket.socket] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> TcpRun:
        self.got = [0] * self.flows
        lsock = self.lab.ns_socket(self.dst, socket.AF_INET, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lsock.bind((self.listen_ip, self.port))
            lsock.listen(self.flows)
            lsock.settimeout(5)
            port = lsock.getsockname()[1]
            for i in range(self.flows):
                s = self.lab.ns_socket(self.src, socket.AF_INET, socket.SOCK_STREAM)
                self._senders.append(s)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, self.cc.encode())
                if self.pacing_bps:
                    s.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, self.pacing_bps // 8)
                s.settimeout(5)
                s.connect((self.connect_ip, port))
                conn, _ = lsock.accept()
                conn.settimeout(5)
                self._conns.append(conn)
                self._threads.append(threading.Thread(target=self._send, args=(s,), daemon=True))
                self._threads.append(
                    threading.Thread(target=self._recv, args=(conn, i), daemon=True)
                )
        finally:
            lsock.close()
        for t in self._threads:
            t.start()
        return self

    def _pin(self) -> None:
        if self.cpu is not None:
            os.sched_setaffinity(0, {self.cpu})  # this thread

    def _send(self, s: socket.socket) -> None:
        self._pin()
        buf = memoryview(bytes(256 * 1024))
        try:
            while not self._stop.is_set():
                s.sendall(buf)
        except OSError as e:
            if not self._stop.is_set():
                self.errors.append(f"send: {e}")

    def _recv(self, conn: socket.socket, i: int) -> None:
        self._pin()
        buf = bytearray(1 << 20)
        try:
            while True:
                n = conn.recv_into(buf)
                if not n:
                    return
                self.got[i] += n
        except OSError as e:
            if not self._stop.is_set():
                self.errors.append(f"recv: {e}")

    def sample(self) -> tuple[float, list[int], int, int, int]:
        """(now, bytes read per flow, the senders' retransmissions so far, the retransmission
        timeouts of the senders' namespace so far, the bytes the receivers' kernel took in
        order so far: what the receivers will read, whether they have yet or not)."""
        retrans = sum(tcp_state(s)[1] for s in self._senders)
        received = sum(bytes_received(c) for c in self._conns)
        got = list(self.got)
        return time.monotonic(), got, retrans, tcp_timeouts(self.lab, self.src), received

    def stop(self) -> None:
        """Stop at once: the receivers first (what the senders still queue is not waited for),
        then the senders; closed with a reset (SO_LINGER 0), no FIN queued behind a limit."""
        self._stop.set()
        for s in self._conns + self._senders:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(10)
        for s in self._senders + self._conns:
            s.close()


def bytes_received(sock: socket.socket) -> int:
    """tcpi_bytes_received of a connected TCP socket (struct tcp_info, offset 128, Linux 4.1):
    the payload bytes it took in order, read by the application or not."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 136)
    return int(struct.unpack_from("=Q", info, 128)[0])


def tcp_timeouts(lab: Lab, ns: str) -> int:
    """TcpExt TCPTimeouts of namespace `ns` (/proc/net/netstat as a thread inside it sees it):
    the retransmission timeouts, each an idle RTO (200 ms and more) of a sender."""

    def read() -> list[str]:
        with open("/proc/thread-self/net/netstat") as f:
            return f.read().splitlines()

    lines = lab.in_ns(ns, read)
    for head, vals in zip(lines[0::2], lines[1::2], strict=True):
        if head.startswith("TcpExt:"):
            return int(dict(zip(head.split(), vals.split(), strict=True))["TCPTimeouts"])
    return 0


def measure_tcp(
    run: TcpRun,
    warmup: float,
    window: float,
    counters: Callable[[], dict[str, int]] | None = None,
) -> dict[str, Any]:
    """Start `run`, wait `warmup`, measure for `window`, stop: goodput (bits/s), per flow, the
    retransmitted segments and the retransmission timeouts in the window, and the CPUs other
    jobs took meanwhile; what `counters` count in the window (`counted`: their differences
    between its start and end)."""
    run.start()
    try:
        time.sleep(warmup)
        t0, b0, r0, o0, k0 = run.sample()
        c0 = counters() if counters else {}
        others = Others()
        time.sleep(window)
        t1, b1, r1, o1, k1 = run.sample()
        c1 = counters() if counters else {}
        other_cpus = others.cpus()
    finally:
        run.stop()
    if run.errors:
        raise RuntimeError(f"TCP {run.src} -> {run.connect_ip}: {'; '.join(run.errors[:3])}")
    el = t1 - t0
    per_flow = [(b - a) * 8 / el for a, b in zip(b0, b1, strict=True)]
    return {
        "goodput_bps": round(sum(per_flow)),
        # the same from the receivers' kernel (tcpi_bytes_received): free of the reading
        # threads' lag at the window's two ends
        "received_bps": round((k1 - k0) * 8 / el),
        "per_flow_bps": [round(x) for x in per_flow],
        "retrans": r1 - r0,
        "timeouts": o1 - o0,
        "seconds": round(el, 3),
        "others_cpus": other_cpus,
    } | ({"counted": {k: v - c0.get(k, 0) for k, v in c1.items()}} if counters else {})
