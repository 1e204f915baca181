"""Where the agent's memory goes, per structure (issue 48): `python -m bench.memory [N ...]`.

The agent's own objects, built as `cozyebpf run` builds them against the API: a `KubeSource`
(its informers list the API-server double, `cozylab/kubeapi.FakeKubeAPI`, run in a process of
its own so that its store is not counted) and an `Agent` whose datapath is the real pinned maps
(`PinnedMaps.ensure` in a pin directory of the bench's, no programs: their compilation runs in a
child that exits and holds nothing afterwards). The cluster is `bench/scale.py`'s.

Once the first sync is written, each structure is walked (`deep_size`: `sys.getsizeof` of every
object reachable from it, each object counted once, for the first structure that reaches it, in
the order of STRUCTURES: the records the informers keep are counted there, not again in the
model that holds the same objects). What no structure reaches is the interpreter, the modules,
the allocator's free and fragmented memory: RSS minus the sum. Also:

- RSS before the lists (the interpreter with the agent's modules), after the sync (and after
  the agent's `release_memory`), and the peak (VmHWM) before the walk; with two malloc arenas,
  as `cozyebpf run` sets them;
- the cold start: from the informers' last list (`KubeSource.synced`) to every Service
  forwarding (the first sync's write done: issue 48's measure), and to the agent idle (its
  first tick done: the collection and trim after the write too), beside the time the lists
  themselves took.

Prints a table and writes bench/results/memory-<timestamp>.json. Needs root and bpffs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench.common import RESULTS, log, pin_dir
from bench.control import DEFAULT_CAPACITY, proc_status

#: the structures, in the order they are counted (see the module docstring)
STRUCTURES = (
    ("informer caches (records)", "what the informers keep of each object: the records"),
    ("model inputs", "the model's dicts of the same records, and its slice index"),
    ("incremental state", "per-Service evaluations, outputs, claims, problems"),
    ("desired state", "the MapState the model programs (services, pods, allowed ports)"),
    ("map mirror", "what the maps hold, packed, to encode a write without reading them"),
    ("counter slots (names)", "Service name <-> counter slot"),
    ("source pending, other", "changes not taken yet, the agent's other fields"),
)

_SKIP = (type, type(sys), type(len), type(lambda: 0))


def deep_size(roots: Iterable[Any], seen: set[int]) -> tuple[int, int, int]:
    """(bytes, objects, bytes of str) reachable from `roots` and not in `seen` (updated).
    Dicts are walked by hand: the collector's traversal of a dict with str keys skips them."""
    size = count = strs = 0
    todo = list(roots)
    while todo:
        o = todo.pop()
        i = id(o)
        if i in seen or isinstance(o, _SKIP):
            continue
        seen.add(i)
        n = sys.getsizeof(o)
        size += n
        count += 1
        if isinstance(o, str):
            strs += n
        elif isinstance(o, dict):
            todo.extend(o.keys())
            todo.extend(o.values())
        elif isinstance(o, int | float | bytes | bool) or o is None:
            pass
        else:
            todo.extend(gc.get_referents(o))
    return size, count, strs


def _skip_shared(seen: set[int]) -> None:
    """Objects every structure may point at and none owns: classes, enum members, singletons,
    the small ints and the interned strings of the modules."""
    from cozyebpf.state import Proto

    for m in Proto:
        seen.add(id(m))
        seen.add(id(m.__dict__))
    for o in (None, True, False, (), ""):
        seen.add(id(o))


def _structures(agent: Any, source: Any, maps: Any) -> list[list[Any]]:
    m = agent.model
    model_inputs = [m.services, m.slices, m.foreign, m.nodes, m._slices_of, m._foreign_by_ip]
    desired = [m._full, m.state]
    incremental = [
        v for k, v in vars(m).items() if k not in {"services", "slices", "foreign", "nodes"}
    ]
    incremental = [
        v for v in incremental if not any(v is x for x in (*model_inputs, *desired, m.clock))
    ]
    mirror = [maps._m, maps._hints]
    slots = [maps.slots]
    other = [source._pending, agent._triggers, agent._uncounted, agent.stats]
    return [
        [i.cache for i in source.informers],
        model_inputs,
        incremental,
        desired,
        mirror,
        slots,
        other,
    ]


def _detail(agent: Any, source: Any, maps: Any) -> dict[str, int]:
    """Each field of the model, the mirror and the slots on its own (what the informer caches
    hold not counted; objects shared between fields counted in each)."""
    base: set[int] = set()
    _skip_shared(base)
    deep_size([i.cache for i in source.informers], base)
    fields = {f"model.{k}": v for k, v in vars(agent.model).items() if k != "clock"}
    if maps._m is not None:
        fields |= {f"mirror.{k}": v for k, v in vars(maps._m).items()}
    fields |= {"maps._hints": maps._hints}
    fields |= {f"slots.{k}": v for k, v in vars(maps.slots).items()}
    out = {}
    for name, v in fields.items():
        size = deep_size([v], set(base))[0]
        if size > 10000:
            out[name] = size
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


class MapsOnly:
    """The Datapath protocol on the real pinned maps, without programs (see the docstring)."""

    def __init__(self, maps: Any) -> None:
        self.maps = maps

    def read_state(self) -> Any:
        return self.maps.read_state()

    def apply(self, diff: Any) -> None:
        self.maps.apply(diff)

    def capacity(self) -> Any:
        return self.maps.capacity()

    def uncounted(self) -> tuple[set[str], int]:
        return self.maps.uncounted()  # type: ignore[no-any-return]

    @property
    def attached(self) -> bool:
        return True

    def check(self) -> list[str]:
        return []


_API = """
import sys, time
from bench import scale
from cozylab.kubeapi import FakeKubeAPI
api = FakeKubeAPI(bookmark_interval=1.0)
for o in scale.objects(int(sys.argv[1])):
    api.apply(o)
api.start()
api.kubeconfig(__import__("pathlib").Path(sys.argv[2]))
print("ready", flush=True)
sys.stdin.read()
"""


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(what)
        time.sleep(0.002)


def map_memory(fds: dict[str, int]) -> dict[str, int]:
    """The kernel memory of each map (`memlock` of its fdinfo: what it charges), bytes."""
    out = {}
    for name, fd in fds.items():
        for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
            if line.startswith("memlock:"):
                out[name] = int(line.split()[1])
    return out


def measure(n: int) -> dict[str, Any]:
    """One size, in this process (run each size in a process of its own: `main`)."""
    from cozyebpf.agent import Agent, tune_malloc
    from cozyebpf.datapath.layout import possible_cpus
    from cozyebpf.datapath.maps import PinnedMaps
    from cozyebpf.kube.client import api_client
    from cozyebpf.sources.kube import KubeSource

    tune_malloc()  # as `cozyebpf run` does, before any thread
    capacity = DEFAULT_CAPACITY if n < DEFAULT_CAPACITY - 1000 else 131072
    tmp = Path(tempfile.mkdtemp(prefix="cz-mem-"))
    pins = pin_dir(f"mem{n}")
    api = subprocess.Popen(
        [sys.executable, "-c", _API, str(n), str(tmp / "kubeconfig")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert api.stdout is not None
        if api.stdout.readline().strip() != "ready":
            raise RuntimeError("the API double did not start")
        maps = PinnedMaps.ensure(pins, capacity)
        kernel = map_memory(maps.fds)
        gc.collect()
        rss_base = proc_status(os.getpid(), "VmRSS")
        source = KubeSource(api_client(str(tmp / "kubeconfig")), "cozy-proxy")
        agent = Agent(source, MapsOnly(maps), resync_interval=3600, check_interval=3600)
        wrote: list[tuple[float, float]] = []  # when the first full sync's write was done

        def on_sync(r: Any) -> None:
            if r.kind == "full" and r.ok and not wrote:
                wrote.append((time.monotonic(), _cpu()))

        agent.on_sync.append(on_sync)
        t0 = time.monotonic()
        source.start(agent.notify)
        _wait(lambda: source.synced, 60 + n * 0.003, "the lists")
        t_listed = time.monotonic()
        cpu_listed = _cpu()
        hwm_listed = proc_status(os.getpid(), "VmHWM")
        rss_listed = proc_status(os.getpid(), "VmRSS")
        while agent.stats.syncs < 1:
            agent.tick()
            if agent.stats.syncs < 1:
                agent.notifier.wait(0.01)
        t_synced = time.monotonic()
        cpu_synced = _cpu()
        rss = proc_status(os.getpid(), "VmRSS")
        hwm = proc_status(os.getpid(), "VmHWM")
        assert len(maps.read_state().services) == n
        seen: set[int] = set()
        _skip_shared(seen)
        rows: list[dict[str, Any]] = []
        for (name, what), roots in zip(STRUCTURES, _structures(agent, source, maps), strict=True):
            size, count, strs = deep_size(roots, seen)
            rows.append(
                {
                    "structure": name,
                    "what": what,
                    "bytes": size,
                    "objects": count,
                    "str_bytes": strs,
                }
            )
        counted = sum(r["bytes"] for r in rows)
        detail = _detail(agent, source, maps)
        rows.append(
            {
                "structure": "rest (interpreter, allocator)",
                "what": "RSS after the sync minus the baseline and the structures above",
                "bytes": rss - rss_base - counted,
                "objects": None,
                "str_bytes": None,
            }
        )
        source.stop()
        return {
            "n": n,
            "capacity": capacity,
            "rss_base": rss_base,
            "rss": rss,
            "peak": hwm,
            "peak_lists": hwm_listed,  # the peak before the cold start: the lists'
            "rss_lists": rss_listed,
            "per_service": (rss - rss_base) / n,
            "maps_bytes": sum(v for k, v in kernel.items() if k != "svcstats"),
            "counters_bytes": kernel.get("svcstats", 0),
            "cpus": possible_cpus(),
            "lists_s": t_listed - t0,
            # to every Service forwarding: the first sync written (issue 48's measure)
            "forwarding_s": wrote[0][0] - t_listed,
            "forwarding_cpu_s": wrote[0][1] - cpu_listed,
            # to the agent idle: the first tick done (the collection and trim after the write)
            "cold_start_s": t_synced - t_listed,
            # CPU seconds of the process meanwhile: what a machine shared with other work
            # does not stretch (the wall time above is, with load)
            "cold_start_cpu_s": cpu_synced - cpu_listed,
            "structures": rows,
            "detail": detail,
        }
    finally:
        if api.poll() is None:
            api.kill()
            api.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(pins, ignore_errors=True)


def table(results: list[dict[str, Any]]) -> str:
    mb = 1e6
    head = "| structure | " + " | ".join(f"{r['n'] // 1000}k: MB, B/Service" for r in results)
    lines = [head + " |", "|---|" + "---|" * len(results)]
    for i, (name, _) in enumerate((*STRUCTURES, ("rest (interpreter, allocator)", ""))):
        cells = []
        for r in results:
            row = r["structures"][i]
            cells.append(f"{row['bytes'] / mb:.1f}, {row['bytes'] / r['n']:.0f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for label, key in (
        ("RSS, baseline (before the lists)", "rss_base"),
        ("RSS after the sync", "rss"),
        ("peak (VmHWM)", "peak"),
    ):
        lines.append(f"| {label} | " + " | ".join(f"{r[key] / mb:.1f}" for r in results) + " |")
    lines.append(
        "| per Service above the baseline | "
        + " | ".join(f"{r['per_service']:.0f} B" for r in results)
        + " |"
    )
    lines.append(
        "| peak above the baseline / after the sync (issue 48: at most 1.2) | "
        + " | ".join(f"{peak_ratio(r):.2f}" for r in results)
        + " |"
    )
    lines.append(
        "| lists / cold start to forwarding (last list -> every Service in the maps) / "
        "to idle | "
        + " | ".join(
            f"{r['lists_s']:.2f} / {r['forwarding_s']:.2f} / {r['cold_start_s']:.2f} s"
            for r in results
        )
        + " |"
    )
    return "\n".join(lines)


def peak_ratio(r: dict[str, Any]) -> float:
    """The peak (VmHWM) above the baseline over the RSS after the sync above it."""
    return float((r["peak"] - r["rss_base"]) / (r["rss"] - r["rss_base"]))


#: the measured runs kept in the tree, by commit (bench/README.md's table is made of them)
RECORD = Path(__file__).parent / "memory.json"


def record(commit: str, results: list[dict[str, Any]]) -> None:
    """Merge `results` into RECORD under `commit` (a size measured again replaces the old)."""
    runs = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    by_n = {r["n"]: r for r in runs.get(commit, [])}
    by_n.update({r["n"]: r for r in results})
    runs[commit] = [by_n[n] for n in sorted(by_n)]
    RECORD.write_text(json.dumps(runs, indent=1) + "\n")


def compare(before: str, after: str) -> str:
    """RECORD's runs of two commits side by side: per size and structure, MB and bytes per
    Service, before -> after."""
    runs = json.loads(RECORD.read_text())
    a = {r["n"]: r for r in runs[before]}
    b = {r["n"]: r for r in runs[after]}
    sizes = sorted(a.keys() & b.keys())
    lines = [
        f"| {before} -> {after} | " + " | ".join(f"{n // 1000}k, B/Service" for n in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    names = [row["structure"] for row in a[sizes[0]]["structures"]]
    for i, name in enumerate(names):
        per = [
            (a[n]["structures"][i]["bytes"] / n, b[n]["structures"][i]["bytes"] / n) for n in sizes
        ]
        cells = [f"{x:,.0f} -> {y:,.0f}" for x, y in per]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    figures: list[tuple[str, str, float, str]] = [  # label, key, scale, format
        ("RSS above the baseline, B/Service", "per_service", 1, ",.0f"),
        ("RSS after the sync, MB", "rss", 1e6, ".0f"),
        ("peak (VmHWM), MB", "peak", 1e6, ".0f"),
        ("lists, s", "lists_s", 1, ".1f"),
        ("cold start to idle (last list -> first tick done), s", "cold_start_s", 1, ".1f"),
    ]
    if all("cold_start_cpu_s" in r[n] for r in (a, b) for n in sizes):
        figures.append(("cold start to idle, CPU-s of the agent", "cold_start_cpu_s", 1, ".1f"))
    if all("forwarding_s" in r[n] for r in (a, b) for n in sizes):  # (older records lack it)
        figures.append(("cold start to forwarding, s", "forwarding_s", 1, ".1f"))
        figures.append(("cold start to forwarding, CPU-s", "forwarding_cpu_s", 1, ".1f"))
    for label, key, scale, fmt in figures:
        cells = [f"{a[n][key] / scale:{fmt}} -> {b[n][key] / scale:{fmt}}" for n in sizes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = [f"{peak_ratio(a[n]):.2f} -> {peak_ratio(b[n]):.2f}" for n in sizes]
    lines.append("| peak above the baseline / after the sync | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__.split("\n")[0])
    ap.add_argument("sizes", nargs="*", type=int, default=[10000, 30000])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one size
    ap.add_argument("--out", help="the JSON file (default: bench/results/memory-<time>.json)")
    ap.add_argument(
        "--record",
        action="store_true",
        help=f"also keep the results in {RECORD.relative_to(RECORD.parents[1])} under this commit",
    )
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two recorded commits")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(*args.compare))
        return 0
    if args.one:
        print(json.dumps(measure(args.sizes[0])))
        return 0
    results = []
    for n in args.sizes:
        log(f"memory at {n} Services")
        out = subprocess.run(
            [sys.executable, "-m", "bench.memory", "--one", str(n)],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout
        results.append(json.loads(out.splitlines()[-1]))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.out or RESULTS / f"memory-{time.strftime('%Y-%m-%dT%H%M%S')}.json")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    path.write_text(json.dumps({"commit": commit, "results": results}, indent=1) + "\n")
    if args.record:
        record(commit, results)
    print(table(results))
    print(f"\n{path}")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench-memory"
    sys.exit(main())
