"""`python -m bench [--quick] [--only PART,...]`: run the benchmarks, print the table and the
targets, write bench/results/<timestamp>.json, bench/results/chart.png and bench/chart.png.
A missed target is reported loudly but does not fail the run; an error in a part does (exit 1,
after the other parts ran and everything created was removed)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from bench import charts, common, report

PARTS = ("progrun", "mapwrites", "datapath", "kubeovn", "limits", "control")


def _check() -> list[str]:
    import shutil

    missing = []
    if os.geteuid() != 0:
        missing.append("root")
    for tool in ("ip", "nsenter", "nft", "ethtool"):
        if not shutil.which(tool):
            missing.append(f"the {tool} command")
    if not os.path.ismount("/sys/fs/bpf"):
        missing.append("bpffs at /sys/fs/bpf")
    try:
        import bcc  # noqa: F401
    except ImportError:
        missing.append("bcc (python3-bpfcc; use the repo's .venv)")
    return missing


def _report_again(path: str) -> int:
    """--report: the table and chart of an earlier results file."""
    import json
    from pathlib import Path

    loaded = json.loads(Path(path).read_text())
    loaded["targets"] = report.targets(loaded)
    print(report.table(loaded))
    chart_png = common.RESULTS / "chart.png"
    try:
        charts.chart(loaded, chart_png)
    except ImportError:  # as report.write: the table is the report, the chart an extra
        print("\nno chart: pip install matplotlib")
        return 0
    print(f"\nchart: {chart_png} (copy it to bench/chart.png for the README)")
    return 0


def _part(part: str) -> Callable[[common.Params], dict[str, Any]]:
    """The function that runs `part` (imported only when it runs)."""
    if part == "progrun":
        from bench.progrun import main_progrun as fn
    elif part == "mapwrites":
        from bench.mapwrites import main_mapwrites as fn
    elif part == "datapath":
        from bench.datapath import main_datapath as fn
    elif part == "kubeovn":
        from bench.kubeovn import main_kubeovn as fn
    elif part == "limits":
        from bench.limits import main_limits as fn
    else:
        from bench.control import main_control as fn
    return fn


def _run_parts(parts: list[str], params: common.Params, res: dict[str, Any]) -> None:
    """Each part in turn, its result or error into `res`; what a part left behind removed
    after it (and after all, also on SIGTERM)."""
    try:
        for part in parts:
            common.log(f"=== {part}")
            try:
                res[part] = _part(part)(params)
            except KeyboardInterrupt:
                raise
            except Exception as e:
                traceback.print_exc()
                res["errors"][part] = f"{type(e).__name__}: {e}"
            finally:
                res["loadavg"][part] = common.loadavg()
                left = common.cleanup_leftovers()
                if left:
                    common.log(f"removed leftovers of {part}: {left}")
    finally:
        left = common.cleanup_leftovers()
        if left:
            common.log(f"removed leftovers: {left}")


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 3 min)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"comma-separated: {','.join(PARTS)}")
    ap.add_argument(
        "--limits-accuracy-only",
        action="store_true",
        help="the limits part without its isolation (bench/guest.py: a flood under emulation "
        "says nothing)",
    )
    ap.add_argument(
        "--limits-isolation-only",
        action="store_true",
        help="the limits part without its accuracy (the isolation rows in both layouts)",
    )
    ap.add_argument(
        "--limits-nodes",
        default="single,kubeovn",
        help="the limits part's nodes, comma-separated: single (a veth per pod), kubeovn (the "
        "pods behind ovn0, bench/kovnnode.py)",
    )
    ap.add_argument(
        "--report",
        metavar="JSON",
        help="print the table and redraw the chart of an earlier results file (no measurements)",
    )
    args = ap.parse_args()
    if args.report:
        return _report_again(args.report)
    missing = _check()
    if missing:
        print("bench: missing " + ", ".join(missing), file=sys.stderr)
        return 2
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r}")

    def _term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _term)
    params = replace(
        common.Params.make(args.quick),
        limits_isolation=not args.limits_accuracy_only,
        limits_accuracy=not args.limits_isolation_only,
        limits_nodes=tuple(n.strip() for n in args.limits_nodes.split(",") if n.strip()),
    )
    for n in params.limits_nodes:
        if n not in ("single", "kubeovn"):
            ap.error(f"--limits-nodes: unknown node {n!r} (single, kubeovn)")
    res: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "quick": args.quick,
        "product": str(common.REPO),
        "machine": common.machine(),
        "params": params.__dict__,
        "errors": {},
        "loadavg": {},
    }
    common.log(
        f"bench {'quick' if args.quick else 'full'}: {', '.join(parts)}; loadavg "
        f"{res['machine']['loadavg_start']}"
    )
    t0 = time.time()
    _run_parts(parts, params, res)
    res["loadavg_end"] = common.loadavg()
    res["seconds"] = round(time.time() - t0, 1)
    res["targets"] = report.targets(res)
    js, png, copy = report.write(res, common.RESULTS, common.BENCH)
    print(report.table(res))
    print(
        f"\nwritten: {js}"
        + (f", {png}" if png else " (no chart: pip install matplotlib)")
        + (f", {copy}" if copy else "")
    )
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
