"""Control plane: the real agent (`python -m cozyebpf run`) in a lab's node namespace, fed from a
manifest file or from the API-server double (cozylab/kubeapi.FakeKubeAPI, listening inside the
node namespace), on synthetic clusters (bench/scale.py) plus one real Service, the probe.

- Cold sync: from process start, and from the datapath being ready, to the pinned maps (opened
  with PinnedMaps.open) holding the whole state. From a manifest also *after* the datapath is
  ready: the agent starts on a small file, then the full one is renamed over it (what is
  timed is the agent's whole work: inotify, parse, model, writes).
- One change -> map written and -> forwarding: the probe Service's EndpointSlice moves between
  two of the lab's pods; a UDP stream to its LB IP (bench/probe.py) shows when the new pod
  gets it. Service changes (allowICMP toggled) -> map written.
- Churn: 100 changes per second of other Services' slices for 60 s, probe changes meanwhile;
  the agent's CPU time; afterwards the maps must equal the full model of the final objects.
- Memory: RSS of the agent's whole process tree (the compile child included while it lives),
  after the sync, steady; and the agent's peak (VmHWM).
"""

from __future__ import annotations

import contextlib
import os
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
from bench.common import REPO, TAG, Params, log, pct, pin_dir, terminate
from bench.mapwrites import nft_transaction
from bench.probe import Probe as Stream
from cozyebpf.config import DEFAULT_GUARD
from cozyebpf.datapath.maps import PinnedMaps
from cozyebpf.model import build_state
from cozyebpf.model.limits import parse_packet_rate
from cozyebpf.state import IPAddress, MapState
from cozylab.kubeapi import FakeKubeAPI
from cozylab.netns import DEFAULT_PODS, UPLINK, Lab

#: maps hold 65,536 Services by default; larger clusters raise it (issue: --max-services)
DEFAULT_CAPACITY = 65536
PODS = DEFAULT_PODS[:2]  # the probe Service's endpoint moves between these two

CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_status(pid: int, key: str) -> int:
    """A kB value of /proc/<pid>/status (VmHWM, VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and of its children that were waited for (the compiler)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / CLK_TCK


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_rss(pid: int) -> int:
    """VmRSS of the process tree, bytes."""
    total = 0
    for p in descendants(pid):
        with contextlib.suppress(OSError):
            total += proc_status(p, "VmRSS")
    return total


@dataclass
class Agent:
    """One `cozyebpf run` in the node namespace; its output is read line by line and each line
    time-stamped on arrival."""

    lab: Lab
    pin: str
    source_args: list[str]
    max_services: int = DEFAULT_CAPACITY
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
            # as deployed: the DaemonSet serves metrics (prometheus_client is in the RSS)
            "--metrics-address",
            "127.0.0.1:9811",
        ]
        if self.max_services != DEFAULT_CAPACITY:
            cmd += ["--max-services", str(self.max_services)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.t_spawn = time.monotonic()
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
            self.lines.append((time.monotonic(), line.rstrip()))

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
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
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
        terminate(self.proc)
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


class Maps:
    """Fast checks on the pinned maps: single lookups through PinnedMaps, no map walks (and no
    knowledge of the map layout)."""

    def __init__(self, pin: str) -> None:
        self.maps = PinnedMaps.open(pin)

    def svc_pod(self, lb: IPAddress) -> IPAddress | None:
        entry = self.maps.lookup_service(lb)
        return entry.pod_ip if entry is not None else None

    def svc_icmp(self, lb: IPAddress) -> bool | None:
        entry = self.maps.lookup_service(lb)
        return entry.allow_icmp if entry is not None else None

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

    def wait(self, check: Any, t0: float, what: str, timeout: float = 30.0) -> float:
        """Poll (every 0.2 ms) until `check()` is true; seconds since `t0`."""
        deadline = t0 + timeout
        while not check():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not in the maps after {timeout}s")
            time.sleep(0.0002)
        return time.monotonic() - t0

    def close(self) -> None:
        self.maps.close()


def _sentinels(st: MapState) -> list[tuple[str, Any]]:
    """The first, middle and last entries of each map in the order the agent writes them."""
    svcs, pods, allowed = sorted(st.services), sorted(st.pods), sorted(st.allowed)
    out: list[tuple[str, Any]] = []
    for kind, xs in (("allow", allowed), ("svc", svcs), ("pod", pods)):
        if xs:
            out += [(kind, xs[0]), (kind, xs[len(xs) // 2]), (kind, xs[-1])]
    return out


def _wait_maps(pin: str, agent: Agent, st: MapState, timeout: float) -> tuple[float, Maps]:
    """Poll until every sentinel is in the maps and they hold exactly `st`; (time, maps)."""
    deadline = time.monotonic() + timeout
    maps: Maps | None = None
    sentinels = _sentinels(st)
    while time.monotonic() < deadline:
        if maps is None:
            with contextlib.suppress(Exception):
                maps = Maps(pin)
        if maps is not None and maps.has_all(sentinels):
            t = time.monotonic()
            if maps.maps.read_state() == st:
                return t, maps
        if agent.proc and agent.proc.poll() is not None:
            raise RuntimeError(f"agent exited ({agent.proc.returncode}):\n{agent.tail()}")
        time.sleep(0.001)
    raise TimeoutError(
        f"maps not programmed after {timeout}s ({_unlike(maps, sentinels, st)}):\n{agent.tail()}"
    )


def _unlike(maps: Maps | None, sentinels: list[tuple[str, Any]], st: MapState) -> str:
    """How the pinned maps differ from `st`, in a line: what a timeout of _wait_maps says."""
    if maps is None:
        return "the pins could not be opened"
    missing = [f"{k} {v}" for k, v in sentinels if not maps.has_all([(k, v)])]
    if missing:
        return f"not in the maps: {', '.join(missing)}"
    got = maps.maps.read_state()
    said = []
    for part in ("services", "pods", "allowed", "ranges", "limits"):
        a, b = getattr(got, part), getattr(st, part)
        if a != b:
            keys = (
                set(a) ^ set(b)
                if isinstance(a, set)
                else {k for k in set(a) | set(b) if a.get(k) != b.get(k)}
            )
            first = sorted(keys, key=str)[:1]
            one = (
                f"; e.g. {first[0]}: {a.get(first[0]) if isinstance(a, dict) else first[0] in a}"
                f" here, {b.get(first[0]) if isinstance(b, dict) else first[0] in b} wanted"
                if first
                else ""
            )
            said.append(f"{part}: {len(keys)} differ{one}")
    return "; ".join(said) or "equal now"


def _ms(xs: list[float]) -> dict[str, Any]:
    return {
        "count": len(xs),
        "p50_ms": round(pct(xs, 50) * 1e3, 2),
        "p99_ms": round(pct(xs, 99) * 1e3, 2),
        "max_ms": round(max(xs) * 1e3, 2) if xs else None,
        "all_ms": [round(x * 1e3, 2) for x in xs],
    }


@dataclass
class Cluster:
    """The objects of one run: n synthetic Services and the probe, and their current form."""

    n: int
    gens: dict[int, int] = field(default_factory=dict)  # Service i -> its pod generation
    flips: dict[int, bool] = field(default_factory=dict)  # Service i -> allowICMP toggled
    probe_pod: int = 0  # index in PODS

    def objects(self) -> list[dict[str, Any]]:
        out = []
        for i in range(self.n):
            out += [
                scale.service(i, self.flips.get(i, False)),
                scale.slice_(i, self.gens.get(i, 0)),
            ]
        return [*out, scale.probe_service(), scale.probe_slice(PODS[self.probe_pod].ip)]

    def state(self) -> MapState:
        """What the agent programs for these objects with its defaults: the node's guard on
        every Service (--guard-packet-rate, and the ceiling that defaults to it)."""
        guard = parse_packet_rate("--guard-packet-rate", DEFAULT_GUARD)
        return build_state(self.objects(), "cozy-proxy", guard_pps=guard, max_pps=guard).state


@dataclass
class ControlBench:
    params: Params
    lab: Lab = field(init=False)
    tmp: Path = field(init=False)

    def __post_init__(self) -> None:
        self.lab = Lab(f"{TAG}-cp", pods=PODS)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"{TAG}-"))

    def _capacity(self, n: int) -> int:
        return DEFAULT_CAPACITY if n < DEFAULT_CAPACITY else 1 << (n + 1).bit_length()

    def _settle(self, agent: Agent) -> dict[str, Any]:
        time.sleep(2.0)  # steady: the compiler has exited, the first resync is done
        return {
            "rss_tree_mb": round(tree_rss(agent.pid) / 2**20, 1),
            "processes": len(descendants(agent.pid)),
            "peak_rss_mb": round(proc_status(agent.pid, "VmHWM") / 2**20, 1),
        }

    def manifest_cold_sync(self, n: int) -> dict[str, Any]:
        """(a) the file there at start; (b) renamed in after the datapath is ready."""
        cl = Cluster(n)
        st = cl.state()
        text = scale.manifest_yaml_objects(cl.objects())
        path, full = self.tmp / f"services-{n}.yaml", self.tmp / f"full-{n}.yaml"
        path.write_text(text)
        res: dict[str, Any] = {"n": n, "source": "manifest", "entries": _entries(st)}
        agent = Agent(self.lab, pin_dir(f"cpm{n}"), ["--manifests", str(path)], self._capacity(n))
        maps: Maps | None = None
        try:
            agent.start()
            timeout = 120 + n * 0.002
            t_ready = agent.wait_line("datapath ready", timeout)
            t_full, maps = _wait_maps(agent.pin, agent, st, timeout)
            res |= {
                "start_to_maps_s": round(t_full - agent.t_spawn, 3),
                "start_to_ready_s": round(t_ready - agent.t_spawn, 3),
                "ready_to_maps_s": round(max(0.0, t_full - t_ready), 3),
            }
            res |= self._settle(agent)
        finally:
            if maps:
                maps.close()
            agent.stop()
        # (b): the agent runs on the probe alone; then the whole cluster arrives
        small = Cluster(0)
        path.write_text(scale.manifest_yaml_objects(small.objects()))
        full.write_text(text)
        agent = Agent(self.lab, pin_dir(f"cpm{n}b"), ["--manifests", str(path)], self._capacity(n))
        maps = None
        try:
            agent.start()
            agent.wait_line("datapath ready", 120)
            _, maps = _wait_maps(agent.pin, agent, small.state(), 60)
            maps.close()
            maps = None
            t0 = time.monotonic()
            os.replace(full, path)
            t_full, maps = _wait_maps(agent.pin, agent, st, 120 + n * 0.002)
            res["file_to_maps_s"] = round(t_full - t0, 3)
            res["edit_to_map"] = self.manifest_edits(path, cl, maps, 20)
        finally:
            if maps:
                maps.close()
            agent.stop()
        log(
            f"cold sync manifest n={n}: {res['file_to_maps_s']}s from the file's arrival (ready "
            f"agent, parse included), {res['start_to_maps_s']}s from start; RSS tree "
            f"{res['rss_tree_mb']} MB; one edit -> map p99 {res['edit_to_map']['p99_ms']} ms"
        )
        return res

    def manifest_edits(self, path: Path, cl: Cluster, maps: Maps, count: int) -> dict[str, Any]:
        """`count` edits of one EndpointSlice each in the whole file (rewritten and renamed
        in, as an editor does): file -> map written."""
        lat = []
        for k in range(count):
            i = (k * 7919 + 3) % cl.n
            cl.gens[i] = cl.gens.get(i, 0) ^ 1
            want = IPv4Address(scale.pod_ip(i, cl.gens[i]))
            lb = IPv4Address(scale.lb_ip(i))
            tmp = path.with_suffix(".tmp")
            tmp.write_text(scale.manifest_yaml_objects(cl.objects()))
            t0 = time.monotonic()
            os.replace(tmp, path)
            lat.append(maps.wait(lambda lb=lb, w=want: maps.svc_pod(lb) == w, t0, "edit"))
        return _ms(lat)

    def api_run(self, n: int, out: dict[str, Any]) -> None:
        """Cold sync from the API double; then single changes and churn where asked."""
        p = self.params
        cl = Cluster(n)
        st = cl.state()
        api = FakeKubeAPI(bookmark_interval=1.0)
        self.lab.in_ns(self.lab.node, api.start)
        for o in cl.objects():
            api.apply(o)
        args = [
            "--kubeconfig",
            str(api.kubeconfig(self.tmp / "kubeconfig")),
            "--node-name",
            "bench-node",
        ]
        agent = Agent(self.lab, pin_dir(f"cpa{n}"), args, self._capacity(n))
        maps: Maps | None = None
        stream: Stream | None = None
        try:
            agent.start()
            timeout = 120 + n * 0.002
            t_ready = agent.wait_line("datapath ready", timeout)
            t_full, maps = _wait_maps(agent.pin, agent, st, timeout)
            res: dict[str, Any] = {
                "n": n,
                "source": "api",
                "entries": _entries(st),
                "start_to_maps_s": round(t_full - agent.t_spawn, 3),
                "start_to_ready_s": round(t_ready - agent.t_spawn, 3),
                "ready_to_maps_s": round(max(0.0, t_full - t_ready), 3),
            }
            res |= self._settle(agent)
            out["cold_sync"].append(res)
            log(
                f"cold sync api n={n}: {res['ready_to_maps_s']}s after datapath ready, "
                f"{res['start_to_maps_s']}s from start; RSS tree {res['rss_tree_mb']} MB"
            )
            if n in p.change_sizes or n == p.churn_size:
                stream = Stream(self.lab, scale.PROBE_LB, [self.lab.pod_ns(pod) for pod in PODS])
                stream.start()
            if n in p.change_sizes:
                count = p.changes[p.change_sizes.index(n)]
                assert stream is not None
                out["changes"].append(self.changes(api, maps, stream, cl, count))
            if n == p.churn_size:
                assert stream is not None
                out["churn"] = self.churn(api, maps, stream, agent, cl)
        finally:
            if stream:
                stream.stop()
            if maps:
                maps.close()
            agent.stop()
            api.stop()

    def probe_change(
        self, api: FakeKubeAPI, maps: Maps, stream: Stream, cl: Cluster
    ) -> tuple[float, float]:
        """Move the probe's endpoint to the other pod: (s to the map, s to the new pod)."""
        cl.probe_pod ^= 1
        want = IPv4Address(PODS[cl.probe_pod].ip)
        lb = IPv4Address(scale.PROBE_LB)
        t0 = time.monotonic()
        api.apply(scale.probe_slice(str(want)))
        t_map = maps.wait(lambda: maps.svc_pod(lb) == want, t0, "probe change")
        t_fwd = stream.at(cl.probe_pod, t0) - t0
        return t_map, t_fwd

    def changes(
        self, api: FakeKubeAPI, maps: Maps, stream: Stream, cl: Cluster, count: int
    ) -> dict[str, Any]:
        """`count` EndpointSlice changes (the probe: map and forwarding) and `count` Service
        changes (allowICMP of a synthetic Service: map), one at a time, on an idle agent."""
        stream.at(cl.probe_pod, 0.0)  # the stream flows
        to_map, to_fwd, svc = [], [], []
        for k in range(count):
            t_map, t_fwd = self.probe_change(api, maps, stream, cl)
            to_map.append(t_map)
            to_fwd.append(t_fwd)
            time.sleep(0.05)
            i = (k * 7919 + 1) % cl.n if cl.n else None
            if i is not None:
                cl.flips[i] = not cl.flips.get(i, False)
                want = (i % 8 == 1) != cl.flips[i]
                lb = IPv4Address(scale.lb_ip(i))
                t0 = time.monotonic()
                api.apply(scale.service(i, cl.flips[i]))
                svc.append(maps.wait(lambda lb=lb, w=want: maps.svc_icmp(lb) == w, t0, "svc"))
            time.sleep(0.05)
        res: dict[str, Any] = {
            "n": cl.n,
            "slice_to_map": _ms(to_map),
            "slice_to_forwarding": _ms(to_fwd),
            "service_to_map": _ms(svc),
        }
        log(
            f"changes n={cl.n}: slice -> map p99 {res['slice_to_map']['p99_ms']} ms, -> "
            f"forwarding p99 {res['slice_to_forwarding']['p99_ms']} ms; Service -> map p99 "
            f"{res['service_to_map']['p99_ms']} ms ({count} each)"
        )
        return res

    def churn(
        self, api: FakeKubeAPI, maps: Maps, stream: Stream, agent: Agent, cl: Cluster
    ) -> dict[str, Any]:
        """`churn_rate` slice changes per second of the synthetic Services for
        `churn_seconds`, probe changes meanwhile; the agent's CPU; the final state."""
        p = self.params
        stop = threading.Event()
        writes = 0

        def writer() -> None:
            nonlocal writes
            interval = 1.0 / p.churn_rate
            t_start = time.monotonic()
            while not stop.is_set():
                i = (writes * 7919 + 13) % cl.n
                cl.gens[i] = cl.gens.get(i, 0) ^ 1
                api.apply(scale.slice_(i, cl.gens[i]))
                writes += 1
                nxt = t_start + writes * interval
                time.sleep(max(0.0, nxt - time.monotonic()))

        th = threading.Thread(target=writer, daemon=True)
        cpu0 = cpu_seconds(agent.pid)
        t_start = time.monotonic()
        th.start()
        to_map, to_fwd = [], []
        while time.monotonic() - t_start < p.churn_seconds:
            time.sleep(1.0)
            t_map, t_fwd = self.probe_change(api, maps, stream, cl)
            to_map.append(t_map)
            to_fwd.append(t_fwd)
        stop.set()
        th.join(10)
        elapsed = time.monotonic() - t_start
        cpu = cpu_seconds(agent.pid) - cpu0
        # the state after the burst: exactly the full model's result
        want = cl.state()
        t0 = time.monotonic()
        converged = None
        while time.monotonic() - t0 < 30:
            if maps.maps.read_state() == want:
                converged = time.monotonic() - t0
                break
            time.sleep(0.05)
        res: dict[str, Any] = {
            "n": cl.n,
            "rate_per_s": round(writes / elapsed, 1),
            "seconds": round(elapsed, 1),
            "writes": writes,
            "probe_to_map": _ms(to_map),
            "probe_to_forwarding": _ms(to_fwd),
            "agent_cpu_s": round(cpu, 2),
            "agent_cpu_per_s": round(cpu / elapsed, 3),
            "syncs": agent.count("programmed:"),
            "state_equals_full_model": converged is not None,
            "converged_after_s": round(converged, 3) if converged is not None else None,
        }
        log(
            f"churn n={cl.n}: {res['rate_per_s']}/s for {res['seconds']}s: probe -> map p99 "
            f"{res['probe_to_map']['p99_ms']} ms, -> forwarding p99 "
            f"{res['probe_to_forwarding']['p99_ms']} ms, agent CPU {res['agent_cpu_per_s']} "
            f"CPU-s/s; final state {'== full model' if converged is not None else 'DIFFERS'}"
        )
        return res

    def run(self) -> dict[str, Any]:
        p = self.params
        self.lab.up()
        out: dict[str, Any] = {"cold_sync": [], "changes": [], "churn": None, "nft": []}
        ns_nft = self.lab.client  # a scratch namespace for the nft comparisons
        for n in p.sizes:
            out["cold_sync"].append(self.manifest_cold_sync(n))
            self.api_run(n, out)
            if n <= 30000:
                full, one = nft_transaction(scale.state(n), ns_nft)
                out["nft"].append(
                    {"n": n, "nft_f_s": round(full, 4), "nft_add_element_ms": round(one * 1e3, 2)}
                )
                log(f"nft n={n}: nft -f {full:.3f}s, nft add element {one * 1e3:.1f} ms")
        return out

    def teardown(self) -> None:
        self.lab.down()
        subprocess.run(["rm", "-rf", str(self.tmp)], check=False)


def _entries(st: MapState) -> int:
    return len(st.services) + len(st.pods) + len(st.allowed)


def main_control(params: Params) -> dict[str, Any]:
    b = ControlBench(params)
    try:
        return b.run()
    finally:
        b.teardown()
