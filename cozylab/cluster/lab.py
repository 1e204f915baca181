"""`ClusterLab`: the lab of the package's docstring brought up and down as one thing (its
network, the echo servers, the API, the speakers, the Cilium-like observer, the agents), the
Services and announcements it changes while scenarios run, and the probes they send."""

from __future__ import annotations

import contextlib
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from cozylab.cilium import CiliumLike, Point
from cozylab.cluster import scenarios
from cozylab.cluster.agents import NodeAgents
from cozylab.cluster.announcer import Speaker, elect
from cozylab.cluster.api import LabApi, PodState, pod_object, vm_pod_object
from cozylab.cluster.rows import Check, Group, Row, run_groups
from cozylab.cluster.scenarios.migration import Migration
from cozylab.cluster.spec import (
    API_IP,
    CANARY_LB,
    CLIENT_IP,
    DEFAULT_WORKLOADS,
    NODE_PORT,
    NODES,
    SERVER_PUSH,
    SERVER_TCP,
    SERVER_UDP,
    TUNNEL,
    Workload,
    node_mac,
    node_name,
)
from cozylab.cluster.topology import Topology
from cozylab.kubecp import ControlPlane
from cozylab.netns import wait_for
from cozylab.traffic import EchoHub, Pusher, describe


class ClusterLab(Topology):
    """The three-node lab of the package's docstring. `up()` builds it (agents included),
    `down()` removes everything; `run_all()` runs every scenario's rows (`table()`)."""

    #: section 7's scenario, one per migration (a lab on another dataplane extends it:
    #: cozylab/realovn/ adds what OVN delivers before the VM's RARP)
    migration_scenario: ClassVar[type[Migration]] = Migration

    def __init__(
        self,
        layout: str = "kubeovn",
        prefix: str = "czc",
        workloads: Sequence[Workload] = DEFAULT_WORKLOADS,
        cmd: Sequence[str] | None = None,
        agent_args: Sequence[str] = (),
        observer: str = "drop",
        workdir: Path | None = None,
        log: Callable[[str], None] = lambda s: None,
        control_plane: ControlPlane | None = None,
    ) -> None:
        super().__init__(layout, prefix, workloads)
        #: the control plane (cozylab/kubecp/): given (shared by the labs of a test module,
        #: each cleaning up what it wrote), or started by `up()` and stopped by `down()`
        self.cp = control_plane
        self._own_cp = control_plane is None
        self.cmd = list(cmd or [sys.executable, "-m", "cozyebpf"])
        self.agent_args = list(agent_args)
        self.observer_mode = observer
        self._workdir = workdir
        self.say = log
        self._agents: NodeAgents | None = None
        self.speakers: dict[int, Speaker] = {}
        self.echo: EchoHub | None = None
        self.pusher: Pusher | None = None
        self.api: LabApi | None = None
        self.observer: CiliumLike | None = None
        self.pod_names = {w.name: f"virt-launcher-{w.name}-{w.index:02d}aaa" for w in workloads}
        self.canary = 0
        #: LB IPs of Services a scenario added, and the node of their backend (announced)
        self.extra_lbs: dict[str, int] = {}
        self.migration: dict[str, dict[str, Any]] = {}  # figures, by migration

    @property
    def workdir(self) -> Path:
        """Logs and the kubeconfig (a temporary directory unless given)."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-{self.layout}-"))
        return self._workdir

    @property
    def agents(self) -> NodeAgents:
        """The nodes' agents (made at first use: they log into the workdir)."""
        if self._agents is None:
            self._agents = NodeAgents(self, self.cmd, self.agent_args, self.workdir)
        return self._agents

    # -- up and down ---------------------------------------------------------------------

    def up(self) -> ClusterLab:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        t0 = time.monotonic()
        self.build()
        self.say(f"topology up in {time.monotonic() - t0:.1f}s ({self.layout})")
        self._servers()
        self._api()
        for n in NODES:
            self.speakers[n] = Speaker(self.lab, self.node(n), "eth0", node_mac(n))
        self.announce()
        self._observer()
        t1 = time.monotonic()
        assert self.api is not None
        self.agents.api_env = self.api.cp.env()
        for n in NODES:
            self.agents.identity[n] = self.api.agent_identity(n, self.workdir / f"sa-node{n}")
        for n in NODES:
            self.agents.start(n, wait=False)
        for n in NODES:
            self.agents.wait(n)
        self.wait_programmed()
        self.say(f"agents ready in {time.monotonic() - t1:.1f}s")

    def _servers(self) -> None:
        """Echo servers in every pod (TCP 80, 81, UDP 53), on the nodes (the kubelet's port,
        for section 12) and on the server (and its download)."""
        self.echo = EchoHub()
        for w in self.workloads.values():
            for kind, port in ((socket.SOCK_STREAM, 80), (socket.SOCK_STREAM, 81)):
                self.echo.serve(self.lab, self.pod_ns(w.name), kind, port)
            self.echo.serve(self.lab, self.pod_ns(w.name), socket.SOCK_DGRAM, 53)
        for n in NODES:
            self.echo.serve(self.lab, self.node(n), socket.SOCK_STREAM, NODE_PORT)
        self.echo.serve(self.lab, self.server, socket.SOCK_STREAM, SERVER_TCP)
        self.echo.serve(self.lab, self.server, socket.SOCK_DGRAM, SERVER_UDP)
        self.pusher = Pusher(self.lab, self.server, SERVER_PUSH)

    def _api(self) -> None:
        """The control plane on the ToR's segment (API_IP), the Nodes, the VMs' Services and
        virt-launcher Pods (the EndpointSlice controller writes their slices), the canary."""
        t0 = time.monotonic()
        if self.cp is None:
            self.cp = ControlPlane(self.prefix, self.workdir / "cp", API_IP, self.say).start()
        self.cp.attach(self.tor, "br0", 24)
        self.api = LabApi(self.cp, self.workdir)
        self.api.setup()
        for n in NODES:
            self.api.put_node(n)
        for w in self.vms:
            self.api.put_service(w)
            self.set_endpoints(w, [self.location[w.name]], wait=False)
        self._canary_bump()
        self.api.wait_slices([w.name for w in self.vms])
        self.say(f"API objects written in {time.monotonic() - t0:.1f}s")

    def _observer(self) -> None:
        """The Cilium-like program: on ovn0 and the tunnel, both ways (kubeovn), on eth0
        ingress (perpod, where Cilium's bpf_host sits)."""
        if self.layout == "kubeovn":
            points = [
                Point(ns, dev, (hook,), n)
                for n in NODES
                for ns, dev in ((self.node(n), "ovn0"), (self.ovs(n), TUNNEL))
                for hook in ("ingress", "egress")
            ]
        else:
            points = [Point(self.node(n), "eth0", ("ingress",), n) for n in NODES]
        lbs = {lb: 0 for lb in [w.lb_ip for w in self.vms if w.lb_ip] + [CANARY_LB]}
        self.observer = CiliumLike(self.lab, points, lbs, self.observer_mode == "drop")

    def observed_devices(self) -> str:
        """The devices `_observer` puts the Cilium-like program on in each node, as section 9's
        rows name them."""
        return f"ovn0 + {TUNNEL}" if self.layout == "kubeovn" else "eth0"

    def down(self) -> None:
        if self._agents:
            self._agents.kill()
        if self.observer:
            with contextlib.suppress(Exception):
                self.observer.close()
            self.observer = None
        for sp in self.speakers.values():
            with contextlib.suppress(Exception):
                sp.close()
        self.speakers.clear()
        if self.echo:
            self.echo.close()
            self.echo = None
        if self.pusher:
            self.pusher.close()
            self.pusher = None
        if self.api:
            if not self._own_cp:
                with contextlib.suppress(Exception):
                    self.api.clean()
            self.api = None
        if self.cp is not None and self._own_cp:
            self.cp.stop()
            self.cp = None
        if self._agents:
            self._agents.detach()
        else:
            self.remove_pins()
        self.remove_namespaces()

    def __enter__(self) -> ClusterLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # -- Services, announcements ---------------------------------------------------------

    def set_endpoints(
        self, w: Workload, nodes: Sequence[int], pods: Sequence[str] = (), wait: bool = True
    ) -> None:
        """w's endpoints: ready on `nodes`, as its virt-launcher pods `pods` (default: its pod
        now), each bound to its node and Running and Ready as the kubelet writes it; any other
        running pod of w completes (phase Succeeded: KubeVirt's source pod after a migration).
        The EndpointSlice controller writes the slice; `wait`: until it did."""
        assert self.api is not None
        names = list(pods) or [self.pod_names[w.name]] * len(nodes)
        for n, name in zip(nodes, names, strict=True):
            self.api.put_pod(vm_pod_object(w, name, n), PodState(w.name, n, w.ip))
        for name, p in list(self.api.pods.items()):
            if p.service == w.name and p.phase == "Running" and name not in names:
                self.api.set_pod(name, PodState(w.name, p.node, w.ip, False, "Succeeded"))
        if wait:
            self.api.wait_slices([w.name])

    def set_ready(self, w: Workload, ready: bool) -> None:
        """w's pod now Ready or not (its readiness probe, as the kubelet writes it)."""
        assert self.api is not None
        name = self.pod_names[w.name]
        self.api.set_pod(name, PodState(w.name, self.location[w.name], w.ip, ready))
        self.api.wait_slices([w.name])

    def _canary_bump(self) -> str:
        """A Service of the lab's own whose one pod gets a new IP at every sync (the lab's
        marker: no kubelet changes a pod's IP, the API allows it): once every agent programmed
        the new IP, every agent took the writes before it (one watch stream, in order;
        `sync_agents` waits for the controller's slices first). Returns the IP to wait for."""
        assert self.api is not None
        self.canary += 1
        canary = Workload(
            "lab-canary", 99, 3, f"10.244.3.{200 + self.canary % 50}", CANARY_LB, whole_ip=True
        )
        state = PodState(canary.name, 3, canary.ip)
        if self.canary == 1:
            self.api.put_service(canary)
            labels = {"vm.kubevirt.io/name": canary.name}
            self.api.put_pod(pod_object(canary.name, labels, 3), state)
        else:
            self.api.set_pod(canary.name, state)
        return canary.ip

    def sync_agents(self, timeout: float = 15) -> None:
        """Wait until the EndpointSlice controller wrote what the lab's pods say, and every
        running agent took every API write made so far."""
        assert self.api is not None
        self.api.wait_slices({p.service for p in self.api.pods.values()} - {"lab-canary"})
        want = self._canary_bump()
        for a in self.agents.by_node.values():
            if a.proc is not None:
                wait_for(
                    lambda a=a: self.agents.lb_map(a).get(CANARY_LB) == want,  # type: ignore[misc]
                    timeout,
                    f"{node_name(a.node)}'s agent to take the API's writes",
                )

    def announce(self, ready: dict[str, list[int]] | None = None) -> dict[str, int | None]:
        """Tell each speaker what it announces: the elected node of each LB IP."""
        ready = ready or self.ready()
        owners = {w.lb_ip: elect(w.lb_ip, ready[w.name]) for w in self.vms if w.lb_ip}
        owners.update({lb: elect(lb, [n]) for lb, n in self.extra_lbs.items()})
        owners[CANARY_LB] = 3
        for n, sp in self.speakers.items():
            sp.announce({ip for ip, o in owners.items() if o == n})
        return owners

    def ready(self) -> dict[str, list[int]]:
        """The nodes with a ready endpoint of each VM (where it runs)."""
        return {w.name: [self.location[w.name]] for w in self.vms}

    def wait_programmed(self, timeout: float = 30) -> None:
        """Until every agent programmed every VM's LB IP to its pod IP."""
        self.agents.wait_programmed({w.lb_ip: w.ip for w in self.vms if w.lb_ip}, timeout)

    # -- probes --------------------------------------------------------------------------

    def tcp(self, ns: str, addr: str, port: int, timeout: float = 2.0) -> tuple[str | None, str]:
        """Connect from `ns`, send a line, read the echo: (the peer the server saw, "") or
        (None, what went wrong)."""
        try:
            with self.lab.ns_socket(ns, socket.AF_INET, socket.SOCK_STREAM) as c:
                c.settimeout(timeout)
                c.connect((addr, port))
                c.sendall(b"probe\n")
                data = b""
                while not data.endswith(b"probe\n"):
                    chunk = c.recv(1024)
                    if not chunk:
                        return None, "closed by the peer"
                    data += chunk
                return data.split(b" ", 1)[0].decode(), ""
        except OSError as e:
            return None, describe(e)

    def udp(self, ns: str, addr: str, port: int, timeout: float = 1.0) -> tuple[str | None, str]:
        """One datagram (two tries): (the peer the server saw, "") when the echo came back
        from addr:port, else (None, what happened)."""
        with self.lab.ns_socket(ns, socket.AF_INET, socket.SOCK_DGRAM) as c:
            c.settimeout(timeout)
            what = "timeout"
            for _ in range(2):
                try:
                    c.sendto(b"probe", (addr, port))
                    while True:
                        data, peer = c.recvfrom(2048)
                        if peer == (addr, port):
                            return data.split(b" ", 1)[0].decode(), ""
                        what = f"answer from {peer[0]}:{peer[1]}, not {addr}:{port}"
                except OSError as e:
                    what = what if isinstance(e, TimeoutError) else describe(e)
            return None, what

    def ping(self, ns: str, addr: str) -> bool:
        p = self.lab.exec(ns, "ping", "-c", "1", "-W", "1", addr, check=False)
        return p.returncode == 0

    # -- checks: a probe and what its row wants of it -------------------------------------

    def check(self, proto: str, ns: str, addr: str, port: int, want: str | None) -> Check:
        """A TCP or UDP echo from `ns` to addr:port: PASS when it completes (and the far side
        saw `want` as the source, unless `want` is None)."""
        seen, err = (self.tcp if proto == "tcp" else self.udp)(ns, addr, port)
        what = f"{proto}/{port}"
        if seen is None:
            return False, f"{what}: {err}"
        if want is not None and seen != want:
            return False, f"{what}: the far side saw {seen}, want {want}"
        return True, f"{what}: the far side saw {seen}"

    def check_icmp(self, lb: str, allowed: bool) -> Check:
        """A ping from the client to `lb`: answered when `allowed`, else dropped and counted."""
        before = sum(self.agents.counted("drop_icmp").values())
        ok = self.ping(self.client, lb)
        if allowed:
            return ok, f"ping {'answered' if ok else 'unanswered'}"
        # silence alone proves nothing (a route, a timeout): the filter must have counted it
        dropped = sum(self.agents.counted("drop_icmp").values()) - before
        return not ok and dropped > 0, (
            f"ping {'answered' if ok else 'unanswered'} (ICMP not allowed: must be dropped); "
            f"drop_icmp +{dropped}"
        )

    def check_unlisted(self, lb: str, whole: bool, ns: str | None = None) -> Check:
        """TCP to port 81 of `lb`, which no Service lists: whole-IP delivers it, a port filter
        drops it and counts it."""
        before = sum(self.agents.counted("drop_port").values())
        seen, err = self.tcp(ns or self.client, lb, 81, timeout=1.0)
        if whole:
            return seen == CLIENT_IP, f"whole-IP: tcp/81 {'saw ' + seen if seen else err}"
        if seen is not None:
            return False, f"tcp/81 is not listed but was answered (the pod saw {seen})"
        # a timeout alone proves nothing: the port filter must have counted the SYNs
        dropped = sum(self.agents.counted("drop_port").values()) - before
        what = "dropped" if err == "timeout" else err
        return err == "timeout" and dropped > 0, f"tcp/81 not listed: {what}; drop_port +{dropped}"

    # -- the scenarios ---------------------------------------------------------------------

    def table(self) -> list[Group]:
        """Every scenario's rows, in the order they run (`scenarios.table`)."""
        return scenarios.table(self)

    def run_all(self) -> list[Row]:
        return run_groups(self.table(), self.layout)
