"""A forwarding probe, as a user would see a change: a steady UDP stream to an LB IP from the
lab's client, and receivers in two pods that report the moment the stream switches pods.

Each side runs in its own process (so the bench process's threads do not delay it):

    python -m bench.probe send NS DST PORT          # ~3,500 datagrams/s until killed
    python -m bench.probe recv PORT NS0 NS1 ...     # prints "<i> <time>" when pod i gets the
                                                    # stream (and before, when another had it)

Times are CLOCK_MONOTONIC (time.monotonic()), the same clock in every process, so the bench
compares them with the moment it made a change.
"""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cozylab.netns import Lab

INTERVAL = 0.0002  # the sender's pause; with Python's overhead about 3,500 datagrams/s


def send(ns: str, dst: str, port: int) -> None:
    s = Lab().ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM)
    seq = 0
    while True:
        with contextlib.suppress(OSError):  # no route for a moment: the probe goes on
            s.sendto(seq.to_bytes(8, "big"), (dst, port))
        seq += 1
        time.sleep(INTERVAL)


def recv(port: int, namespaces: list[str]) -> None:
    socks = []
    for ns in namespaces:
        s = Lab().ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        s.bind(("0.0.0.0", port))
        s.setblocking(False)
        socks.append(s)
    print("ready", flush=True)
    last = -1
    while True:
        ready, _, _ = select.select(socks, [], [])
        now = time.monotonic()
        for s in ready:
            i = socks.index(s)
            while True:
                try:
                    s.recv(64)
                except BlockingIOError:
                    break
            if i != last:
                print(f"{i} {now:.6f}", flush=True)
                last = i


@dataclass
class Probe:
    """The probe's two processes, and the switches the receiver reported."""

    lab: Lab
    lb_ip: str
    pod_namespaces: list[str]
    port: int = 9999
    switches: list[tuple[int, float]] = field(default_factory=list)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    def start(self) -> None:
        py = [sys.executable, "-m", "bench.probe"]
        rx = subprocess.Popen(
            [*py, "recv", str(self.port), *self.pod_namespaces], stdout=subprocess.PIPE, text=True
        )
        self._procs.append(rx)
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError("the probe receiver did not start")
        threading.Thread(target=self._read, args=(rx,), daemon=True).start()
        self._procs.append(
            subprocess.Popen([*py, "send", self.lab.client, self.lb_ip, str(self.port)])
        )

    def _read(self, rx: subprocess.Popen[str]) -> None:
        assert rx.stdout is not None
        for line in rx.stdout:
            i, t = line.split()
            self.switches.append((int(i), float(t)))

    def at(self, pod: int, after: float, timeout: float = 30.0) -> float:
        """The first moment after `after` the stream reached pod `pod` (index in
        pod_namespaces) after being elsewhere, or since `after` if it never left."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, t in list(self.switches):
                if i == pod and t > after:
                    return t
            time.sleep(0.0005)
        raise TimeoutError(f"the probe stream did not reach pod {pod} within {timeout}s")

    def current(self) -> int | None:
        return self.switches[-1][0] if self.switches else None

    def stop(self) -> None:
        for p in self._procs:
            p.kill()
            p.wait()
        self._procs.clear()


if __name__ == "__main__":
    if sys.argv[1] == "send":
        send(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        recv(int(sys.argv[2]), sys.argv[3:])
