"""The `cozyebpf` command line. Every option can also be set as COZYEBPF_<OPTION>, e.g.
COZYEBPF_PIN_DIR, COZYEBPF_RUN_DEVICES (click's auto_envvar_prefix)."""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from types import FrameType

import click

from cozyebpf import __version__
from cozyebpf.datapath.maps import DEFAULT_PIN_DIR
from cozyebpf.errors import CozyError

log = logging.getLogger("cozyebpf")

pin_dir_option = click.option(
    "--pin-dir",
    default=DEFAULT_PIN_DIR,
    show_default=True,
    envvar="COZYEBPF_PIN_DIR",
    help="bpffs directory of our pinned maps and links.",
)


def _setup_logging(level: str) -> None:
    """Our loggers at `level`; libraries (pyroute2, ...) at WARNING whatever the level."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S%z",
        stream=sys.stderr,
    )
    logging.getLogger("cozyebpf").setLevel(getattr(logging, level.upper()))


def _fail(e: CozyError) -> None:
    click.echo(f"cozyebpf: error: {e}", err=True)
    sys.exit(1)


@click.group(
    context_settings={"auto_envvar_prefix": "COZYEBPF", "help_option_names": ["-h", "--help"]}
)
@click.version_option(__version__, prog_name="cozyebpf")
def main() -> None:
    """cozyebpf: give a LoadBalancer IP as a whole to one pod (stateless 1:1 NAT in eBPF).

    \b
    Examples:
      cozyebpf run --manifests examples/services.yaml --devices eth0
      cozyebpf maps dump
      cozyebpf maps dump --json
      cozyebpf detach
    """


@main.command()
@click.option(
    "--manifests",
    type=click.Path(dir_okay=False),
    help="Multi-document YAML with Services and EndpointSlices (status included); re-read "
    "when it changes.",
)
@click.option(
    "--devices",
    required=True,
    help="Comma-separated uplink devices: XDP ingress and tc egress are attached to each. "
    "Nothing else is touched.",
)
@pin_dir_option
@click.option(
    "--proxy-name",
    default="cozy-proxy",
    show_default=True,
    help="Value of the service.kubernetes.io/service-proxy-name label that selects Services.",
)
@click.option(
    "--xdp-mode",
    type=click.Choice(["native", "generic"]),
    default="native",
    show_default=True,
    help="XDP attach mode; generic (skb) XDP is slower than tc and only for drivers "
    "without native XDP.",
)
@click.option(
    "--tc-mode",
    type=click.Choice(["auto", "tcx", "legacy"]),
    default="auto",
    show_default=True,
    help="Egress hook: tcx (Linux >= 6.6, placed before every other program) or a legacy "
    "clsact filter; auto picks tcx where the kernel has it.",
)
@click.option(
    "--poll-interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between checks of the manifest file.",
)
@click.option(
    "--resync-interval",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds between full resyncs that repair drift in the maps.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
def run(
    manifests: str | None,
    devices: str,
    pin_dir: str,
    proxy_name: str,
    xdp_mode: str,
    tc_mode: str,
    poll_interval: float,
    resync_interval: float,
    log_level: str,
) -> None:
    """Load and attach the datapath, then keep its maps in sync with the Services.

    Runs in the foreground in the current network namespace. On SIGTERM/SIGINT it exits and
    leaves the datapath in place (traffic keeps flowing); `cozyebpf detach` removes it.

    \b
    Example:
      cozyebpf run --manifests examples/services.yaml --devices eth0,eth1
    """
    _setup_logging(log_level)
    from cozyebpf.agent import Agent
    from cozyebpf.datapath.bpf import BpfDatapath
    from cozyebpf.sources.manifest import ManifestSource

    if not manifests:
        _fail(CozyError("--manifests is required (the Kubernetes API source is not built yet)"))
        return
    devs = [d.strip() for d in devices.split(",") if d.strip()]
    dp = BpfDatapath(devs, pin_dir=pin_dir, xdp_mode=xdp_mode, tc_mode=tc_mode)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("got %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        dp.start()
        log.info("datapath ready on %s (maps in %s)", ", ".join(devs), pin_dir)
        Agent(ManifestSource(manifests), dp, proxy_name, poll_interval, resync_interval).run(stop)
    except CozyError as e:
        _fail(e)
    finally:
        dp.close()
    log.info("stopped; the datapath stays attached (remove it with `cozyebpf detach`)")


@main.group()
def maps() -> None:
    """Inspect the pinned maps."""


@maps.command("dump")
@pin_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def maps_dump(pin_dir: str, as_json: bool) -> None:
    """Show services, allowed ports, flows, counters and attachments from the pinned maps.

    Works from any process on the node while `cozyebpf run` is running (or after it stopped:
    the datapath stays pinned).
    """
    from cozyebpf.datapath.bpf import dump_pinned
    from cozyebpf.dump import render_dump

    try:
        d = dump_pinned(pin_dir)
    except CozyError as e:
        _fail(e)
        return
    click.echo(json.dumps(d, indent=2) if as_json else render_dump(d))


@main.command()
@pin_dir_option
def detach(pin_dir: str) -> None:
    """Remove every program, link, filter and pinned map of cozyebpf (the uninstall path).

    Legacy clsact filters are found in the current network namespace.
    """
    from cozyebpf.datapath.attach import detach_all

    removed = detach_all(pin_dir)
    for r in removed:
        click.echo(f"removed {r}")
    click.echo(f"detached: {len(removed)} objects removed" if removed else "nothing to detach")
