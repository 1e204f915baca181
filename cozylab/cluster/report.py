"""The lab's report and command line: `python -m cozylab.cluster` (`make cluster-lab`) builds
each layout, runs its rows, tears it down, prints the table of scenario x case x layout and the
migration figures, and exits 1 when a row fails."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from cozylab.cluster.lab import ClusterLab
from cozylab.cluster.rows import Row, names
from cozylab.cluster.spec import LAYOUTS


def planned_cases(layout: str) -> list[tuple[str, str]]:
    """The (scenario, case) of every row `run_all()` returns for `layout` with the default
    workloads, read from the same table, without building anything (for the tests' ids)."""
    return names(ClusterLab(layout).table())


def format_table(rows: Sequence[Row]) -> str:
    heads = ("scenario", "case", "layout", "result", "detail")
    cells = [(r.scenario, r.case, r.layout, r.result, r.detail) for r in rows]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
        for i, h in enumerate(heads[:4])
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads[:4], widths, strict=True)) + "  detail"]
    for c in cells:
        lines.append(
            "  ".join(x.ljust(w) for x, w in zip(c[:4], widths, strict=True)) + "  " + c[4]
        )
    return "\n".join(lines)


def run_layout(layout: str, **kw: Any) -> tuple[list[Row], dict[str, Any], float]:
    """Build the lab, run every scenario, tear it down: (rows, migration figures, seconds)."""
    t0 = time.monotonic()
    lab = ClusterLab(layout, **kw)
    lab.say(f"the agents' and the control plane's logs in {lab.workdir}")
    with lab:
        rows = lab.run_all()
        figures = lab.migration
    return rows, figures, time.monotonic() - t0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the lab comes down in its finally/__exit__


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--layout", type=click.Choice([*LAYOUTS, "both"]), default="both", show_default=True)
@click.option(
    "--observer",
    type=click.Choice(["drop", "count"]),
    default="drop",
    show_default=True,
    help="The Cilium-like program drops packets to LB IPs (as the wildcard entry does), or "
    "only counts them (to see what the datapath alone does).",
)
@click.option("--prefix", default="czc", show_default=True, help="Namespace and pin prefix.")
@click.option("--agent-arg", "agent_args", multiple=True, help="An extra argument of `run`.")
@click.option("--json", "as_json", type=click.Path(dir_okay=False), help="Write the rows here.")
def main(
    layout: str, observer: str, prefix: str, agent_args: tuple[str, ...], as_json: str | None
) -> None:
    """The cluster lab of issue 18: three nodes, Kube-OVN-like or per-pod veths, one agent
    per node; prints a table of scenario x case x layout with PASS/FAIL and the migration
    figures. Exits 1 when a row fails. Run as root from the repository root."""
    if os.geteuid() != 0:
        raise click.ClickException("run as root (namespaces, BPF)")
    signal.signal(signal.SIGTERM, _interrupted)
    all_rows: list[Row] = []
    figures: dict[str, dict[str, Any]] = {}
    for lay in LAYOUTS if layout == "both" else (layout,):
        click.secho(f"==> layout {lay}", bold=True)
        rows, fig, secs = run_layout(
            lay, prefix=prefix, agent_args=agent_args, observer=observer, log=click.echo
        )
        click.echo(f"{lay}: {sum(r.ok for r in rows)}/{len(rows)} PASS in {secs:.0f}s")
        all_rows += rows
        if fig:
            figures[lay] = fig
    click.echo()
    click.echo(format_table(all_rows))
    for lay, figs in figures.items():
        for desc, fig in figs.items():
            click.secho(f"\nlive migration ({lay}), {desc}:", bold=True)
            for k, v in fig.items():
                click.echo(f"  {k}: {round(v) if isinstance(v, float) else v}")
    if as_json:
        Path(as_json).write_text(
            json.dumps({"rows": [r.__dict__ for r in all_rows], "migration": figures}, indent=1)
        )
    failed = [r for r in all_rows if not r.ok]
    click.echo(f"\n{len(all_rows) - len(failed)}/{len(all_rows)} PASS")
    sys.exit(1 if failed else 0)
