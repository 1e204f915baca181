"""The real-OVN lab's table and command line (`make real-ovn-lab`, `python -m cozylab.realovn`)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import click

from cozylab.cluster import format_table
from cozylab.cluster.report import _interrupted
from cozylab.cluster.rows import names
from cozylab.realovn.lab import RealOvnLab
from cozylab.realovn.spec import PORT_GROUP_MOVES


def planned_cases() -> list[tuple[str, str]]:
    """The (scenario, case) of every row `RealOvnLab.run_all()` returns with the default
    workloads, read from the table it runs, without building anything: the model's kubeovn
    rows (the migrations' with the RARP row, the Cilium view on ovn0 alone), then OVN's
    port-security rows and the real dataplane's own."""
    return names(RealOvnLab().table())


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--prefix", default="czo", show_default=True, help="Namespace and pin prefix.")
@click.option("--observer", type=click.Choice(["drop", "count"]), default="drop", show_default=True)
@click.option(
    "--port-group-move",
    type=click.Choice(PORT_GROUP_MOVES),
    default="both-ready",
    show_default=True,
    help="When a migrating VM's port joins the target node's port group (its traffic to "
    "outside then leaves by that node): when the target pod is routed, as read in Kube-OVN, "
    "or at the switch-over.",
)
@click.option("--agent-arg", "agent_args", multiple=True, help="An extra argument of `run`.")
@click.option("--json", "as_json", type=click.Path(dir_okay=False), help="Write the rows here.")
def main(
    prefix: str,
    observer: str,
    port_group_move: str,
    agent_args: tuple[str, ...],
    as_json: str | None,
) -> None:
    """The cluster lab on real OVS and OVN (issue 27): every row of the model's kubeovn
    layout plus OVN's port security, on three chassis. Exits 1 when a row fails."""
    if os.geteuid() != 0:
        raise click.ClickException("run as root (namespaces, BPF, OVS)")
    signal.signal(signal.SIGTERM, _interrupted)
    t0 = time.monotonic()
    lab = RealOvnLab(
        prefix=prefix,
        observer=observer,
        port_group_move=port_group_move,
        agent_args=agent_args,
        log=click.echo,
    )
    click.echo(f"agent and daemon logs in {lab.workdir}")
    with lab:
        t_up = time.monotonic() - t0
        rows = lab.run_all()
    total = time.monotonic() - t0
    click.echo(format_table(rows))
    for desc, fig in lab.migration.items():
        click.secho(f"\nlive migration, {desc}:", bold=True)
        for k, v in fig.items():
            click.echo(f"  {k}: {round(v) if isinstance(v, float) else v}")
    for desc, steps in lab.bindings.items():
        click.secho(f"\nOVN port binding, {desc}:", bold=True)
        for line in steps:
            click.echo(f"  {line}")
    failed = [r for r in rows if not r.ok]
    click.echo(
        f"\n{len(rows) - len(failed)}/{len(rows)} PASS; up (agents ready) in {t_up:.1f}s, "
        f"{total:.0f}s in all; {lab.timings}"
    )
    if as_json:
        Path(as_json).write_text(
            json.dumps({"rows": [r.__dict__ for r in rows], "migration": lab.migration}, indent=1)
        )
    sys.exit(1 if failed else 0)
