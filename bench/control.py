"""Control plane: the real agent (`python -m cozyebpf run`) in a lab's node namespace, fed from a
manifest file or from the API-server double (tests/kubeapi.FakeKubeAPI, listening inside the
node namespace). Times run from the write (agent start for a cold sync, FakeKubeAPI.apply for a
change) to the moment the pinned maps, opened with PinnedMaps.open, hold the new entries. The
agent's peak RSS is VmHWM and its CPU time utime+stime, from /proc/<pid>.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

from bench import scale
from bench.common import REPO, TAG, Params, log, pct, pin_dir
from bench.mapwrites import nft_transaction
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.lab import DEFAULT_PODS, UPLINK, Lab
from cozyebpf.state import IPAddress, MapState
from tests.kubeapi import FakeKubeAPI

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid: int, key: str) -> int:
    """A kB value of /proc/<pid>/status (VmHWM, VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


@dataclass
class Agent:
    """One `cozyebpf run` in the node namespace; its output is read line by line and each line
    time-stamped on arrival."""

    lab: Lab
    pin: str
    source_args: list[str]
    proc: subprocess.Popen[str] | None = None
    lines: list[tuple[float, str]] = field(default_factory=list)
    t_spawn: float = 0.0
    _thread: threading.Thread | None = None

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "cozyebpf",
            "run",
            *self.source_args,
            "--devices",
            UPLINK,
            "--pin-dir",
            self.pin,
            "--poll-interval",
            "0.05",
            "--resync-interval",
            "3600",
            "--check-interval",
            "3600",
            "--log-level",
            "info",
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.t_spawn = time.perf_counter()
        self.proc = self.lab.popen(
            self.lab.node,
            *cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self.proc and self.proc.stdout
        for line in self.proc.stdout:
            self.lines.append((time.perf_counter(), line.rstrip()))

    def first(self, text: str) -> float | None:
        for t, line in list(self.lines):
            if text in line:
                return t
        return None

    def count(self, text: str) -> int:
        return sum(1 for _, line in list(self.lines) if text in line)

    def tail(self, n: int = 15) -> str:
        return "\n".join(line for _, line in self.lines[-n:])

    def wait_line(self, text: str, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            t = self.first(text)
            if t is not None:
                return t
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"agent exited ({self.proc.returncode}):\n{self.tail()}")
            time.sleep(0.005)
        raise TimeoutError(f"no {text!r} from the agent in {timeout}s:\n{self.tail()}")

    @property
    def pid(self) -> int:
        assert self.proc
        return self.proc.pid

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.lab.exec(
            self.lab.node,
            sys.executable,
            "-m",
            "cozyebpf",
            "detach",
            "--pin-dir",
            self.pin,
            check=False,
        )


class Probe:
    """Fast checks on the pinned maps: single lookups through PinnedMaps, no map walks (and no
    knowledge of the map layout)."""

    def __init__(self, pin: str) -> None:
        self.maps = PinnedMaps.open(pin)

    def svc_pod(self, lb: IPv4Address) -> IPAddress | None:
        entry = self.maps.lookup_service(lb)
        return entry.pod_ip if entry is not None else None

    def has_all(self, sentinels: list[tuple[str, Any]]) -> bool:
        for kind, key in sentinels:
            if kind == "svc":
                ok = self.maps.lookup_service(key) is not None
            elif kind == "pod":
                ok = self.maps.lookup_pod(key) is not None
            else:
                ok = self.maps.has_allowed(key)
            if not ok:
                return False
        return True

    def close(self) -> None:
        self.maps.close()


def _sentinels(st: MapState) -> list[tuple[str, Any]]:
    """The first and last entries of each map in the order the agent writes them."""
    svcs, pods, allowed = sorted(st.services), sorted(st.pods), sorted(st.allowed)
    out: list[tuple[str, Any]] = []
    for kind, xs in (("allow", allowed), ("svc", svcs), ("pod", pods)):
        if xs:
            out += [(kind, xs[0]), (kind, xs[len(xs) // 2]), (kind, xs[-1])]
    return out


def _wait_maps(pin: str, agent: Agent, st: MapState, timeout: float) -> tuple[float, Probe]:
    """Poll until every sentinel is in the maps; return (time seen, probe)."""
    deadline = time.perf_counter() + timeout
    probe: Probe | None = None
    sentinels = _sentinels(st)
    while time.perf_counter() < deadline:
        if probe is None:
            with contextlib.suppress(Exception):
                probe = Probe(pin)
        if probe is not None and probe.has_all(sentinels):
            t = time.perf_counter()
            live = probe.maps.read_state()
            if live == st:
                return t, probe
        if agent.proc and agent.proc.poll() is not None:
            raise RuntimeError(f"agent exited ({agent.proc.returncode}):\n{agent.tail()}")
        time.sleep(0.001)
    raise TimeoutError(f"maps not programmed after {timeout}s:\n{agent.tail()}")


@dataclass
class ControlBench:
    params: Params
    lab: Lab = field(init=False)
    tmp: Path = field(init=False)

    def __post_init__(self) -> None:
        self.lab = Lab(f"{TAG}-cp", pods=DEFAULT_PODS[:1])
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{TAG}-"))

    def cold_sync(
        self, n: int, source: str, api: FakeKubeAPI | None
    ) -> tuple[dict[str, Any], Agent, Probe]:
        st = scale.state(n)
        pin = pin_dir(f"cp{source}{n}")
        if source == "manifest":
            path = self.tmp / f"services-{n}.yaml"
            path.write_text(scale.manifest_yaml(n))
            args = ["--manifests", str(path)]
        else:
            assert api is not None
            args = [
                "--kubeconfig",
                str(api.kubeconfig(self.tmp / "kubeconfig")),
                "--node-name",
                "bench-node",
            ]
        agent = Agent(self.lab, pin, args)
        agent.start()
        timeout = 60 + n * (0.01 if source == "manifest" else 0.002)
        t_ready = agent.wait_line("datapath ready", 120)
        t_full, probe = _wait_maps(pin, agent, st, timeout)
        t_prog = agent.first("programmed:")
        res = {
            "n": n,
            "source": source,
            "entries": len(st.services) + len(st.pods) + len(st.allowed),
            "start_to_maps_s": round(t_full - agent.t_spawn, 3),
            "ready_to_maps_s": round(t_full - t_ready, 3),
            "start_to_ready_s": round(t_ready - agent.t_spawn, 3),
            "log_programmed_after_ready_s": round(t_prog - t_ready, 3) if t_prog else None,
            "peak_rss_mb": round(proc_status(agent.pid, "VmHWM") / 2**20, 1),
            "rss_after_sync_mb": round(proc_status(agent.pid, "VmRSS") / 2**20, 1),
            "cpu_s": round(cpu_seconds(agent.pid), 2),
        }
        log(
            f"cold sync {source} n={n}: {res['ready_to_maps_s']}s after datapath ready "
            f"({res['start_to_maps_s']}s from start), peak RSS {res['peak_rss_mb']} MB"
        )
        return res, agent, probe

    def changes(self, api: FakeKubeAPI, probe: Probe, n: int, count: int) -> dict[str, Any]:
        """`count` single EndpointSlice changes, one at a time: p50/p99 write -> map."""
        lat: list[float] = []
        gens: dict[int, int] = {}
        for k in range(count):
            i = (k * 7919) % n  # spread over the Services
            g = gens.get(i, 0) ^ 1
            gens[i] = g
            lb, want = IPv4Address(scale.lb_ip(i)), IPv4Address(scale.pod_ip(i, g))
            obj = scale.slice_(i, g)
            t0 = time.perf_counter()
            api.apply(obj)
            deadline = t0 + 30
            while probe.svc_pod(lb) != want:
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"change {k} of Service {i} not seen in 30s")
                time.sleep(0.0002)
            lat.append(time.perf_counter() - t0)
            time.sleep(0.01)
        res = {
            "n": n,
            "changes": count,
            "p50_ms": round(pct(lat, 50) * 1e3, 2),
            "p99_ms": round(pct(lat, 99) * 1e3, 2),
            "max_ms": round(max(lat) * 1e3, 2),
            "all_ms": [round(x * 1e3, 2) for x in lat],
        }
        log(f"change latency n={n}: p50 {res['p50_ms']} ms, p99 {res['p99_ms']} ms")
        return res

    def churn(self, api: FakeKubeAPI, probe: Probe, agent: Agent, n: int) -> dict[str, Any]:
        p = self.params
        interval = 1.0 / p.churn_rate
        pending: dict[int, tuple[IPv4Address, IPv4Address, float]] = {}
        lat: list[float] = []
        lock = threading.Lock()
        stop = threading.Event()
        gens: dict[int, int] = {}

        def poller() -> None:
            while not (stop.is_set() and not pending):
                with lock:
                    items = list(pending.items())
                for i, (lb, want, t0) in items:
                    if probe.svc_pod(lb) == want:
                        t = time.perf_counter()
                        with lock:
                            if pending.get(i, (None, None, None))[2] == t0:
                                del pending[i]
                                lat.append(t - t0)
                    elif time.perf_counter() - t0 > 30:
                        with lock:
                            pending.pop(i, None)
                time.sleep(0.0005)

        th = threading.Thread(target=poller, daemon=True)
        syncs0 = agent.count("programmed:")
        cpu0 = cpu_seconds(agent.pid)
        th.start()
        t_start = time.perf_counter()
        writes = 0
        while True:
            now = time.perf_counter()
            if now - t_start >= p.churn_seconds:
                break
            i = (writes * 7919 + 13) % n
            g = gens.get(i, 0) ^ 1
            gens[i] = g
            lb, want = IPv4Address(scale.lb_ip(i)), IPv4Address(scale.pod_ip(i, g))
            obj = scale.slice_(i, g)
            t0 = time.perf_counter()
            with lock:
                pending[i] = (lb, want, t0)
            api.apply(obj)
            writes += 1
            nxt = t_start + writes * interval
            time.sleep(max(0.0, nxt - time.perf_counter()))
        elapsed = time.perf_counter() - t_start
        stop.set()
        th.join(40)
        cpu = cpu_seconds(agent.pid) - cpu0
        res = {
            "n": n,
            "rate_per_s": round(writes / elapsed, 1),
            "seconds": round(elapsed, 1),
            "writes": writes,
            "applied": len(lat),
            "lost": writes - len(lat),
            "p50_ms": round(pct(lat, 50) * 1e3, 2),
            "p99_ms": round(pct(lat, 99) * 1e3, 2),
            "max_ms": round(max(lat) * 1e3, 2) if lat else None,
            "agent_cpu_s": round(cpu, 2),
            "agent_cpu_per_s": round(cpu / elapsed, 3),
            "syncs": agent.count("programmed:") - syncs0,
        }
        log(
            f"churn n={n}: {res['rate_per_s']}/s for {res['seconds']}s: p50 {res['p50_ms']} ms, "
            f"p99 {res['p99_ms']} ms, agent CPU {res['agent_cpu_s']} s, {res['syncs']} syncs"
        )
        return res

    def run(self) -> dict[str, Any]:
        p = self.params
        self.lab.up()
        out: dict[str, Any] = {"cold_sync": [], "changes": [], "churn": None, "nft": []}
        ns_nft = self.lab.client  # a scratch namespace for the nft comparisons
        for n in p.sizes:
            for source in ("manifest", "api"):
                api = None
                if source == "api":
                    api = FakeKubeAPI(bookmark_interval=1.0)
                    self.lab.in_ns(self.lab.node, api.start)
                    for o in scale.objects(n):
                        api.apply(o)
                agent: Agent | None = None
                probe: Probe | None = None
                try:
                    res, agent, probe = self.cold_sync(n, source, api)
                    out["cold_sync"].append(res)
                    if api is not None and n in p.change_sizes:
                        count = p.changes[p.change_sizes.index(n)]
                        out["changes"].append(self.changes(api, probe, n, count))
                    if api is not None and n == p.churn_size:
                        out["churn"] = self.churn(api, probe, agent, n)
                finally:
                    if probe:
                        probe.close()
                    if agent:
                        agent.stop()
                    if api:
                        api.stop()
            full, one = nft_transaction(scale.state(n), ns_nft)
            out["nft"].append(
                {"n": n, "nft_f_s": round(full, 4), "nft_add_element_ms": round(one * 1e3, 2)}
            )
            log(f"nft n={n}: nft -f {full:.3f}s, nft add element {one * 1e3:.1f} ms")
        return out

    def teardown(self) -> None:
        self.lab.down()
        subprocess.run(["rm", "-rf", str(self.tmp)], check=False)


def main_control(params: Params) -> dict[str, Any]:
    b = ControlBench(params)
    try:
        return b.run()
    finally:
        b.teardown()
