"""The `cozyebpf` command line. Every option can also be set as COZYEBPF_<OPTION>, e.g.
COZYEBPF_PIN_DIR, COZYEBPF_RUN_DEVICES (click's auto_envvar_prefix)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import click

from cozyebpf import __version__
from cozyebpf.config import DEFAULT_GUARD, RunConfig
from cozyebpf.datapath.layout import DEFAULT_MAX_SERVICES, LAYOUT_VERSION, OLDEST_COMPATIBLE
from cozyebpf.datapath.maps import DEFAULT_PIN_DIR
from cozyebpf.errors import CozyError, PermanentError
from cozyebpf.safepoint import SafePoints, Stopping

if TYPE_CHECKING:
    from cozyebpf.agent import Agent
    from cozyebpf.datapath.bpf import BpfDatapath
    from cozyebpf.model import Problem
    from cozyebpf.sources import Source

log = logging.getLogger("cozyebpf")

#: what `run` stops on its way out, in order: (what it is, for the log; how to stop it)
Stoppers = list[tuple[str, Callable[[], None]]]

pin_dir_option = click.option(
    "--pin-dir",
    default=DEFAULT_PIN_DIR,
    show_default=True,
    envvar="COZYEBPF_PIN_DIR",
    help="bpffs directory of our pinned maps and links.",
)


def _setup_logging(level: str) -> None:
    """Our loggers at `level`; libraries (pyroute2, ...) at WARNING whatever the level. Times
    in UTC with milliseconds (a change takes milliseconds)."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
        stream=sys.stderr,
    )
    logging.Formatter.converter = time.gmtime
    logging.getLogger("cozyebpf").setLevel(getattr(logging, level.upper()))


def _fail(e: CozyError) -> NoReturn:
    click.echo(f"cozyebpf: error: {e}", err=True)
    sys.exit(1)


class _Commands(click.Group):
    """Every command, now and to come: an error cozyebpf raises on purpose (CozyError) ends in
    one line `cozyebpf: error: ...` and exit status 1, never in a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CozyError as e:
            _fail(e)


@click.group(
    cls=_Commands,
    context_settings={"auto_envvar_prefix": "COZYEBPF", "help_option_names": ["-h", "--help"]},
)
@click.version_option(
    __version__,
    prog_name="cozyebpf",
    message=f"%(prog)s %(version)s (map layout {LAYOUT_VERSION}; agents of layout "
    f"{OLDEST_COMPATIBLE} or newer can run on its maps)",
)
def main() -> None:
    """cozyebpf: give a LoadBalancer IP as a whole to one pod (stateless 1:1 NAT in eBPF).

    \b
    Examples:
      cozyebpf run --manifests examples/services.yaml --devices eth0
      cozyebpf status
      cozyebpf explain --from 198.51.100.2 --to 203.0.113.10:443
      cozyebpf monitor --type drop
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
    help="Comma-separated uplink devices, or `auto` for the device(s) of the default IPv4 "
    "route: XDP ingress and tc egress are attached to each. Nothing else is touched.",
)
@click.option(
    "--pod-devices",
    default="auto",
    show_default=True,
    help="Comma-separated devices through which pods reach the node (Kube-OVN's ovn0; "
    "per-pod veths), `auto` for ovn0 where it exists, or `none`. A tc program placed first "
    "on their ingress translates a managed pod's traffic that leaves the node before "
    "netfilter (so the CNI's masquerade never sees the pod IP), and pods' answers to "
    "connections this node opened to their LB IPs.",
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
    help="tc hooks: tcx (Linux >= 6.6, placed before every other program) or a legacy "
    "clsact filter (before 6.6: placed first at priority 1, beside Cilium's); auto picks tcx "
    "where the kernel has it. legacy where it has tcx runs after every tcx program.",
)
@click.option(
    "--poll-interval",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds between checks of the manifest file besides inotify (a safety net, and "
    "the only way where inotify cannot watch it).",
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
@click.option(
    "--ingress-hook",
    type=click.Choice(["auto", "xdp", "tcx"]),
    default="auto",
    show_default=True,
    help="Where ingress translation runs: native XDP, or tcx placed before every other tc "
    "program. auto takes native XDP where the driver has it, else tcx (never generic XDP).",
)
@click.option(
    "--on-foreign-xdp",
    type=click.Choice(["fail", "tcx"]),
    default="fail",
    show_default=True,
    help="When a device already has an XDP program that is not ours (it is never replaced): "
    "fail, or attach ingress behind it with tcx.",
)
@click.option(
    "--check-interval",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds between checks that our programs are attached (and first in tcx); what is "
    "missing is re-attached and logged.",
)
@click.option(
    "--remove-cozy-proxy-table",
    is_flag=True,
    help="Delete cozy-proxy's nftables table `ip cozy_proxy` at start (it would NAT the same "
    "traffic twice); without it, its presence is only warned about.",
)
@click.option(
    "--kubeconfig",
    type=click.Path(dir_okay=False),
    help="Kubeconfig for the API server; without it (and without --manifests) the in-cluster "
    "service account is used.",
)
@click.option(
    "--node-name",
    default="",
    help="This node's name, reported in Events (the DaemonSet sets it from spec.nodeName).",
)
@click.option(
    "--max-services",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_SERVICES,
    show_default=True,
    help="Services the maps hold (each map is sized from it; kernel memory grows with it, "
    "see the README). Over it, the oldest Services are programmed and each one left out is "
    "reported. A change resizes the pinned maps at the next start, entries kept.",
)
@click.option(
    "--health-address",
    default="",
    help="HOST:PORT for /healthz, /readyz and /status (the agent's part of `cozyebpf status`), "
    "e.g. 127.0.0.1:9810 or [::1]:9810; 0.0.0.0, :: or no host: every address of both "
    "families; off when empty.",
)
@click.option(
    "--metrics-address",
    default="",
    help="HOST:PORT for Prometheus metrics at /metrics (e.g. 0.0.0.0:9811: every address of "
    "both families, or one address of either); off when empty.",
)
@click.option(
    "--counted-services",
    type=click.IntRange(min=1),
    default=None,
    help="How many Services get counters of their own (per-Service metrics); the others are "
    "counted node-wide only. Each costs 96 bytes of kernel memory per CPU. Default: every "
    "Service the maps hold, within 64 MiB (65,536 with up to 10 CPUs, 7,280 with 96).",
)
@click.option(
    "--flow-timeout-udp",
    type=click.FloatRange(min=0),
    default=120,
    show_default=True,
    help="Seconds a UDP flow the pod opened admits replies after the pod's last datagram "
    "(port-filter mode and pods with loadBalancerSourceRanges); 0: never expires.",
)
@click.option(
    "--flow-timeout-icmp",
    type=click.FloatRange(min=0),
    default=30,
    show_default=True,
    help="Seconds an ICMP echo the pod sent admits its replies; 0: never.",
)
@click.option(
    "--flow-timeout-tcp",
    type=click.FloatRange(min=0),
    default=432000,
    show_default=True,
    help="Seconds an established TCP (and SCTP) flow admits replies after the pod's last "
    "segment (5 days, as Linux conntrack); 0: never.",
)
@click.option(
    "--flow-timeout-tcp-closing",
    type=click.FloatRange(min=0),
    default=10,
    show_default=True,
    help="Seconds a TCP flow admits replies once the pod sent a FIN or RST; 0: never.",
)
@click.option(
    "--reserved-cidrs",
    default="",
    help="Comma-separated prefixes no LB IP may take, besides the node's and every Node's "
    "addresses, the managed pods' IPs and 169.254.0.0/16 (always refused); e.g. the "
    "Service ClusterIP range and the pod CIDR: 10.96.0.0/12,10.244.0.0/16.",
)
@click.option(
    "--reserved-exclude-devices",
    default="kube-ipvs0",
    show_default=True,
    help="Comma-separated devices whose addresses are Services', not the node's own "
    "(kube-proxy's IPVS dummy device): an LB IP may be one of them.",
)
@click.option(
    "--cluster-role",
    default="cozyebpf",  # portsec.CLUSTER_ROLE, deploy/'s name
    show_default=True,
    help="The name of the ClusterRole that grants this agent its rights, for the messages "
    "that name a missing right (the Helm chart passes the one it made).",
)
@click.option(
    "--trusted-endpoints",
    type=click.Choice(["controller", "any"]),
    default="controller",
    show_default=True,
    help="With the API as source, whose endpoints are programmed: `controller`, only "
    "EndpointSlices managed by Kubernetes' EndpointSlice controller and endpoints that are "
    "Pods of the Service's namespace (what a tenant cannot forge; others are warned about); "
    "`any`, slices as written (a platform that writes its own). A manifest is always trusted.",
)
@click.option(
    "--watch-timeout",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="With the API as source, the seconds each watch asks the API server to keep it open "
    "(timeoutSeconds): the server ends it then, and the watch resumes from its last "
    "resourceVersion without listing again.",
)
@click.option(
    "--metrics-auth",
    type=click.Choice(["auto", "kubernetes", "none"]),
    default="auto",
    show_default=True,
    help="Who may read the metrics: `kubernetes`, over HTTPS, callers whose bearer token the "
    "API server authenticates (TokenReview) and allows to get /metrics (SubjectAccessReview); "
    "`none`, anyone, over plain HTTP; `auto`, kubernetes with the API as source, none with "
    "--manifests.",
)
@click.option(
    "--metrics-cert-dir",
    default="",
    help="A directory with tls.crt and tls.key for the metrics' HTTPS (e.g. a mounted "
    "Secret); without them a self-signed certificate is made at start.",
)
@click.option(
    "--host-routing",
    type=click.Choice(["auto", "on", "off"]),
    default="auto",
    show_default=True,
    help="on: a packet cozyebpf translated goes straight to the device the kernel's FIB names "
    "(bpf_redirect_neigh, TTL - 1), skipping the node's netfilter, conntrack and second route "
    "lookup; TTL 1, too big for the device, fragments and options still take the stack. "
    "Behind XDP ingress a tc program hands on what XDP let through. off: the path through "
    "the stack. auto: on where pod-facing hooks are attached (--pod-devices; a Cozystack node, "
    "where it was measured), else off (docs/behaviour.md, Host routing).",
)
@click.option(
    "--guard-packet-rate",
    default=DEFAULT_GUARD,
    show_default=True,
    help="The node's guard: packets per second into each Service's LB IPs, dropped at XDP "
    "above it, for every Service that sets no networking.cozystack.io/ingressPacketRate of its "
    "own (a flood to one VM is cut before the node does any work for it). A number with an "
    "optional k, M, G suffix; 0: no guard (docs/behaviour.md, Limits per public IP).",
)
@click.option(
    "--max-packet-rate",
    default="",
    help="The node's ceiling of a Service's own networking.cozystack.io/ingressPacketRate: "
    "a Service that asks for more gets this, with a Warning Event naming it. A number with an "
    "optional k, M, G suffix; 0: no ceiling. [default: the guard's rate] A guard above the "
    "ceiling is refused at start (docs/behaviour.md, Limits per public IP).",
)
# (longer than 80 lines with its docstring, which is the command's --help: the steps are
# functions of their own)
def run(**options: Any) -> None:
    """Load and attach the datapath, then keep its maps in sync with the Services.

    The Services come from --manifests (a file, re-read when it changes) or else from the
    Kubernetes API (--kubeconfig, or the in-cluster service account). Runs in the foreground in
    the current network namespace. On SIGTERM/SIGINT it exits and leaves the datapath in place
    (traffic keeps flowing); `cozyebpf detach` removes it.

    \b
    Examples:
      cozyebpf run --manifests examples/services.yaml --devices eth0,eth1
      cozyebpf run --kubeconfig ~/.kube/config --devices auto --health-address 127.0.0.1:9810
      cozyebpf run --devices auto --metrics-address 0.0.0.0:9811
    """
    cfg = RunConfig(**options)
    _setup_logging(cfg.log_level)
    log.info("cozyebpf %s (map layout %d)", __version__, LAYOUT_VERSION)
    from cozyebpf.agent import Agent, tune_malloc

    tune_malloc()  # before any thread
    from cozyebpf.datapath.attach import resolve_devices, resolve_pod_devices
    from cozyebpf.datapath.bpf import handle_cozy_proxy
    from cozyebpf.kube.portsec import checks
    from cozyebpf.memlimit import MemoryWatch
    from cozyebpf.sources.local import LocalAddresses

    stop = threading.Event()
    safe = SafePoints()
    wake: list[Callable[[], None]] = []  # the agent's notify, once there is an agent
    dp: BpfDatapath | None = None
    stoppers: Stoppers = []
    try:
        _stop_on_signals(stop, safe, wake)  # inside: a stop from now on lands in `except`
        reserved_cidrs = cfg.reserved_networks()
        guard_pps = cfg.guard_pps()
        max_pps = cfg.max_pps()
        devs = resolve_devices(cfg.devices)
        pod_devs = resolve_pod_devices(cfg.pod_devices, devs)
        node = cfg.node_name or socket.gethostname()
        source, client, on_problems = _source(cfg, node, stoppers)
        # behind ovn0: one warning now, and each VM's pod on this node needs port security
        unverified, portsec = checks(
            pod_devs, client, node, cfg.resync_interval, cluster_role=cfg.cluster_role
        )
        dp = cfg.datapath(devs, pod_devs)
        dp.guard = safe.section
        handle_cozy_proxy(cfg.remove_cozy_proxy_table)
        dp.prepare()
        dp.begin()  # compiling in a child; the control plane starts meanwhile
        local = LocalAddresses(cfg.exclude_devices())
        stoppers.append(("the address follower", local.stop))
        agent = Agent(
            source,
            dp,
            cfg.proxy_name,
            cfg.resync_interval,
            on_problems,
            cfg.check_interval,
            portsec=portsec,
            unverified=unverified,
            local=local,
            reserved_cidrs=reserved_cidrs,
            guard_pps=guard_pps,
            max_pps=max_pps,
            memory=MemoryWatch(node),
        )
        wake.append(agent.notify)
        local.start()
        source.start(agent.notify)
        stoppers.insert(0, ("the source", source.stop))
        if portsec is not None:
            portsec.start()
            stoppers.insert(0, ("the port-security check", portsec.stop))
        _serve(cfg, agent, client, stoppers)
        _attach_while_syncing(agent, dp, stop, cfg.pin_dir)
        agent.run(stop)
    except Stopping:
        pass
    except CozyError as e:
        _fail(e)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal: cleanup goes on
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if dp is not None:
            stoppers.append(("the datapath's descriptors", dp.close))
        _stop_all(stoppers)
    log.info("stopped; the datapath stays attached (remove it with `cozyebpf detach`)")
    _exit_at_once(0)


def _stop_all(stoppers: Stoppers) -> None:
    """Call every stopper, in order, each even if one before it failed (a failure is logged
    with what it stopped; the others still run, and so does the exit)."""
    for what, fn in stoppers:
        try:
            fn()
        except Exception as e:
            log.error("stopping %s failed: %s: %s", what, type(e).__name__, e)


def _stop_on_signals(
    stop: threading.Event, safe: SafePoints, wake: list[Callable[[], None]]
) -> None:
    """SIGTERM and SIGINT set `stop`, call `wake` and interrupt whatever runs, a large sync
    included; an attach or a map batch in progress first finishes (cozyebpf.safepoint). A
    second signal waits for the cleanup, unless the section in progress outlived its bound."""

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        if stop.is_set():
            if safe.forced:  # the section in progress outlived its bound
                raise Stopping
            return  # already stopping: let the section or the cleanup finish
        log.info("got %s, stopping", signal.Signals(signum).name)
        stop.set()
        for fn in wake:
            fn()
        safe.request_stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)


def _source(
    cfg: RunConfig, node: str, stoppers: Stoppers
) -> tuple[Source, Any, Callable[[list[Problem]], None] | None]:
    """(the source, the API client or None, where problems go): --manifests, or the API with
    an Event recorder (its stop added to `stoppers`)."""
    if cfg.manifests:
        from cozyebpf.sources.manifest import ManifestSource

        source = ManifestSource(cfg.manifests, cfg.proxy_name, cfg.poll_interval)
        source.check()
        return source, None, None
    from cozyebpf.kube.client import api_client
    from cozyebpf.kube.events import EventRecorder
    from cozyebpf.sources.kube import KubeSource

    client = api_client(cfg.kubeconfig)
    trust_any = cfg.trusted_endpoints == "any"
    kube = KubeSource(
        client,
        cfg.proxy_name,
        watch_timeout=cfg.watch_timeout,
        trust_any_endpoints=trust_any,
        cluster_role=cfg.cluster_role,
    )
    recorder = EventRecorder(client, node, cluster_role=cfg.cluster_role)
    recorder.start()
    stoppers.append(("the Event recorder", recorder.stop))
    return kube, client, recorder.record


def _serve(cfg: RunConfig, agent: Agent, client: Any, stoppers: Stoppers) -> None:
    """The health and metrics servers the options ask for, started (stops into `stoppers`)."""
    if cfg.health_address:
        from cozyebpf.health import HealthServer
        from cozyebpf.status import agent_status

        health = HealthServer(
            cfg.health_address,
            agent.liveness,
            agent.readiness,
            status=lambda: agent_status(agent),
        )
        health.start()
        stoppers.append(("the health server", health.stop))
    if cfg.metrics_address:
        from cozyebpf.metrics import MetricsServer, registry_for

        registry = registry_for(cfg.pin_dir, agent)
        metrics = MetricsServer(cfg.metrics_address, registry, *_metrics_guard(cfg, client))
        metrics.start()
        stoppers.append(("the metrics server", metrics.stop))


def _attach_while_syncing(
    agent: Agent, dp: BpfDatapath, stop: threading.Event, pin_dir: str
) -> None:
    """The control plane turns while the child compiles; the programs are attached once it
    is done (or a stop came first)."""
    while not stop.is_set() and not dp.attached:
        agent.tick()
        if dp.compiled():
            dp.finish()
            hooks = ", ".join(f"{a.device} {a.hook}" for a in dp.attachments.values())
            log.info("datapath ready: %s (maps in %s)", hooks, pin_dir)
        else:
            agent.notifier.wait(0.05)


def _metrics_guard(cfg: RunConfig, client: Any) -> tuple[Any, Any]:
    """(TLS context, authorizer) for the metrics, or (None, None) for plain HTTP to anyone:
    --metrics-auth kubernetes (auto with the API as source; cozyebpf/kube/metricsauth.py), none
    (auto with --manifests: there is no API to check a token with)."""
    mode = cfg.metrics_auth
    if mode == "auto":
        mode = "none" if client is None else "kubernetes"
    if mode == "none":
        log.warning(
            "metrics are served over plain HTTP to anyone who reaches %s (every Service's "
            "name and traffic): --metrics-auth kubernetes serves them over HTTPS to callers "
            "allowed to get /metrics",
            cfg.metrics_address,
        )
        return None, None
    if client is None:
        raise PermanentError("--metrics-auth kubernetes needs the API as source (not --manifests)")
    from cozyebpf.httpserver import UNSPECIFIED
    from cozyebpf.kube.metricsauth import KubeAuthorizer
    from cozyebpf.tls import server_context

    host = cfg.metrics_address.rpartition(":")[0].strip("[]")
    names = [n for n in (host, cfg.node_name or socket.gethostname()) if n not in UNSPECIFIED]
    return server_context(cfg.metrics_cert_dir, names), KubeAuthorizer(client)


def _exit_at_once(status: int) -> NoReturn:
    """Exit without the interpreter's teardown, once everything that matters is done: the
    pins stay, the sources, servers and compiler child are stopped, our descriptors closed;
    logs are flushed here. The teardown would only free the caches object by object, with the
    collector's passes over them: seconds after "stopped" at 70,000 Services (CHANGELOG), for
    memory the kernel frees at once."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


@main.group()
def maps() -> None:
    """Inspect the pinned maps."""


agent_option = click.option(
    "--agent",
    "agent_address",
    envvar=["COZYEBPF_STATUS_AGENT", "COZYEBPF_RUN_HEALTH_ADDRESS"],
    default="",
    help="HOST:PORT of the agent's --health-address, for what only the agent knows (its "
    "last sync, problems, refused Services). Default: COZYEBPF_RUN_HEALTH_ADDRESS, as the "
    "DaemonSet sets it (127.0.0.1:9810); none, and the agent is not asked: `cozyebpf run` "
    "serves /status only with --health-address.",
)


@maps.command("dump")
@pin_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@agent_option
def maps_dump(pin_dir: str, as_json: bool, agent_address: str) -> None:
    """Show services, allowed ports, flows, counters and attachments from the pinned maps,
    and the Services the agent refused (an LB IP already in use: they have no entry).

    Works from any process on the node while `cozyebpf run` is running (or after it stopped:
    the datapath stays pinned; the refused Services then are unknown).
    """
    from cozyebpf.dump import dump_pinned, render_dump
    from cozyebpf.status import with_refused

    try:
        d = with_refused(dump_pinned(pin_dir), agent_address)
    except CozyError as e:
        _fail(e)
        return
    click.echo(json.dumps(d, indent=2) if as_json else render_dump(d))


@main.command()
@pin_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@agent_option
def status(pin_dir: str, as_json: bool, agent_address: str) -> None:
    """The node at a glance: attachments, map layout, Services by mode, the last sync, open
    problems, whether a monitor runs, the top drop reasons.

    \b
    Examples:
      cozyebpf status
      kubectl -n cozy-system exec ds/cozyebpf -- cozyebpf status --json
    """
    from cozyebpf.status import gather, render

    d = gather(pin_dir, agent_address)
    click.echo(json.dumps(d, indent=2) if as_json else render(d))


@main.command()
@click.option(
    "--from",
    "src",
    required=True,
    metavar="IP[:PORT]",
    help="The sender: for ingress a client, for egress the pod. Default source port 40000.",
)
@click.option(
    "--to",
    "dst",
    required=True,
    metavar="IP[:PORT]",
    help="The destination: for ingress the LB IP (or a pod IP), for egress the peer; the port "
    "is needed for tcp, udp and sctp. IPv6 with a port: [IP]:PORT.",
)
@click.option(
    "--proto",
    default="tcp",
    show_default=True,
    metavar="tcp|udp|sctp|icmp|icmpv6|N",
    help="The protocol; icmp and icmpv6 send an echo request, a number a bare payload.",
)
@click.option(
    "--direction",
    type=click.Choice(["ingress", "egress"]),
    default="ingress",
    show_default=True,
    help="ingress: arriving on the device (XDP or tc ingress); egress: a pod's packet leaving.",
)
@click.option("--device", help="The device whose program runs; not needed with one device.")
@click.option(
    "--from-device",
    "in_device",
    metavar="DEV",
    help="egress: the device the packet entered the node by (a pod's veth, ovn0), for the "
    "source check; without it the packet is one the node itself sends.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@pin_dir_option
@agent_option
def explain(
    src: str,
    dst: str,
    proto: str,
    direction: str,
    device: str | None,
    in_device: str | None,
    as_json: bool,
    pin_dir: str,
    agent_address: str,
) -> None:
    """What the datapath does with one packet, and why: verdict, reason, Service, the packet as
    it would leave, and what to change.

    It runs the program attached to the device with BPF_PROG_RUN against the live maps. It
    sends nothing and changes nothing: no counter, flow or fragment entry, no monitor event.

    \b
    Examples:
      cozyebpf explain --from 198.51.100.2 --to 203.0.113.10:443
      cozyebpf explain --from 198.51.100.2 --to 203.0.113.20 --proto icmp
      cozyebpf explain --from 10.244.1.20:40000 --to 198.51.100.2:53 --proto udp \\
          --direction egress --from-device lxc-vm1 --json
    """
    from cozyebpf.explain import explain as run_explain

    e, given = run_explain(pin_dir, src, dst, proto, direction, device, in_device, agent_address)
    click.echo(json.dumps(e.as_dict()) if as_json else e.text(given))


@main.command()
@click.option(
    "--type",
    "kind",
    type=click.Choice(["drop", "all"]),
    default="drop",
    show_default=True,
    help="drop: dropped packets; all: every packet counted for a managed address.",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per event and line.")
@click.option(
    "--rate",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="At most this many events per second on this node (a token bucket in BPF); the "
    "events over it are counted as lost.",
)
@pin_dir_option
def monitor(kind: str, as_json: bool, rate: int, pin_dir: str) -> None:
    """Live events from the running datapath, until interrupted: time, device, direction,
    reason, protocol, source and destination as received, ports, Service and length.

    Events flow only while a monitor runs (the programs read a switch; without it they cost
    nothing), through a BPF ring buffer; events lost to the rate limit or a full buffer are
    counted and reported. One monitor at a time per node.

    \b
    Examples:
      cozyebpf monitor
      cozyebpf monitor --type all --json | jq 'select(.service == "default/vm1")'
    """
    from cozyebpf.monitor import run_monitor

    stop = threading.Event()

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    def emit(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    run_monitor(
        pin_dir,
        kind,
        rate,
        emit,
        lambda note: click.echo(f"cozyebpf monitor: {note}", err=True),
        as_json,
        stop.is_set,
    )


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
