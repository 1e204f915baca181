"""Shared helpers: run parameters, statistics, machine load, names of what the bench creates."""

from __future__ import annotations

import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cozyebpf

BENCH = Path(__file__).resolve().parent
#: the product under test: the tree `cozyebpf` is imported from (normally the repo root; run
#: from a snapshot of another commit to benchmark that one)
REPO = Path(cozyebpf.__file__).resolve().parent.parent
#: where a run's JSON and chart go (COZYEBPF_BENCH_RESULTS: bench/guest.py's guest, whose
#: checkout is read-only, writes them to its shared directory)
RESULTS = Path(os.environ.get("COZYEBPF_BENCH_RESULTS") or BENCH / "results")
PIN_ROOT = "/sys/fs/bpf"
TAG = f"czbench{os.getpid() % 100000}"  # namespaces and pin dirs: unique to this run


def pin_dir(what: str) -> str:
    return f"{PIN_ROOT}/{TAG}-{what}"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Params:
    quick: bool
    reps: int  # interleaved repetitions of each datapath measurement
    seconds: float  # target duration of one datapath measurement
    progrun_repeat: int
    progrun_reps: int
    sizes: tuple[int, ...]  # cold-sync sizes
    change_sizes: tuple[int, ...]  # base sizes for the change latency
    changes: tuple[int, ...]  # single changes, for each of change_sizes
    churn_size: int
    churn_rate: float
    churn_seconds: float
    mapwrite_sizes: tuple[int, ...]
    mapwrite_reps: int
    limits_isolation: bool = True  # the limits part's isolation (--limits-accuracy-only: not)
    limits_accuracy: bool = True  # the limits part's accuracy (--limits-isolation-only: not)
    limits_nodes: tuple[str, ...] = ("single", "kubeovn")  # --limits-nodes

    @classmethod
    def make(cls, quick: bool) -> Params:
        if quick:
            return cls(
                True, 2, 0.25, 1_000_000, 2, (1000,), (1000,), (20,), 1000, 100.0, 10.0, (10000,), 2
            )
        return cls(
            False,
            5,
            0.8,
            2_000_000,
            3,
            (1000, 10000, 30000, 100000),
            (1000, 10000, 30000, 100000),
            (60, 60, 40, 40),
            10000,
            100.0,
            60.0,
            (10000, 30000),
            3,
        )


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def pct(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (nearest rank) of xs."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = max(0, min(len(s) - 1, round(p / 100 * len(s) + 0.5) - 1))
    return float(s[k])


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def cpu_busy(interval: float = 1.0) -> float:
    """Fraction of all CPUs busy over `interval` (from /proc/stat)."""

    def snap() -> tuple[int, int]:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = f[3] + f[4]
        return sum(f), idle

    t0, i0 = snap()
    time.sleep(interval)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def machine() -> dict[str, Any]:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "loadavg_start": loadavg(),
        "cpu_busy_start": round(cpu_busy(1.0), 3),
    }


def sh(*cmd: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def terminate(proc: subprocess.Popen[Any] | None) -> None:
    """Stop an agent the bench started: SIGTERM, 30 s to exit (it detaches nothing on its
    own), then SIGKILL."""
    if proc and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cleanup_leftovers() -> list[str]:
    """Remove namespaces and pin dirs of THIS run (tag) that are still there."""
    from cozyebpf.datapath.attach import detach_all

    removed = []
    for ns in sh("ip", "netns", "list", check=False).stdout.split():
        if ns.startswith(TAG + "-"):
            sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    for name in os.listdir(PIN_ROOT):
        if name.startswith(TAG + "-"):
            try:
                detach_all(os.path.join(PIN_ROOT, name))
            except OSError:
                subprocess.run(["rm", "-rf", os.path.join(PIN_ROOT, name)], check=False)
            removed.append(os.path.join(PIN_ROOT, name))
    return removed


def mpps(dp: dict[str, Any], path: str, variant: str) -> float | None:
    """The datapath part's median Mpps of `variant` on `path` (None: not measured)."""
    e = dp.get("summary", {}).get(path, {}).get(variant)
    return e["mpps"] if e else None
