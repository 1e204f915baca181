"""What a user does with cozyebpf on real nodes, in order, each step checked as the user would
check it (`Story.run` returns one `Row` per check):

1. install: the README's own Install commands (cozylab/realnode/readme.py: the namespace, its
   label, `helm install` of charts/cozyebpf with the uplink device and the image a user sets),
   the DaemonSet's Pods Ready on both nodes under the runtime; inside a Pod, the capabilities
   and seccomp mode the chart asks for; the README's Check commands answer on each node;
2. backends: a Deployment behind a port-filter Service and a VM-like Pod behind a whole-IP
   Service; their EndpointSlices come from the kubelets' probes; TCP, UDP and ICMP through
   both LB IPs from the client; the backends' egress seen as their LB IPs;
3. operate: `cozyebpf status` and `maps dump` in an agent's Pod through the API (exec), its logs
   through the API; the README's Troubleshoot example (`explain`, `monitor`) for a port the
   Service does not list;
4. faults: the agent's process killed inside its container (the kubelet restarts it; traffic
   goes on); a backend Pod deleted and rescheduled on the other node; a readiness probe
   failing (the Service leaves the datapath with a Warning, and comes back);
5. `helm uninstall`: the datapath stays attached and pinned (fail-static), then
   deploy/uninstall/uninstall.yaml detaches it on every node, as the README says;
6. the previous release: its own chart and image (its release commit) installed, `helm upgrade`
   to main, `helm rollback` to it, under traffic; then the same between two builds of main;
   each rollout one node at a time;
7. the last `helm uninstall` and detach: the nodes as before the install.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cozylab.kubecp.spec import Obj
from cozylab.netns import wait_for
from cozylab.realnode import probes, readme, refused
from cozylab.realnode.images import Release
from cozylab.realnode.lab import RealNodeLab
from cozylab.realnode.spec import AGENT_REPOSITORY, CLIENT_IP, LB_FILTERED, LB_WHOLE, NODES
from cozylab.realnode.streams import HUB_TCP, HUB_UDP, pod_name, streams
from cozylab.realnode.workloads import (
    NAMESPACE,
    VM,
    WEB,
    lb_status,
    namespace,
    services,
    vm_pod,
    web_deployment,
)
from cozylab.traffic import EchoHub

REPO = Path(__file__).resolve().parents[2]
AGENT_NAMESPACE = "cozy-system"
RELEASE = "cozyebpf"
AGENT_SELECTOR = "app.kubernetes.io/name=cozyebpf"
#: the values a user sets: the uplink device, the proxy name
USER_VALUES = ("--set", "agent.devices=eth0", "--set", "agent.proxyName=cozy-proxy")
#: CAP_SYS_ADMIN (21) and CAP_NET_ADMIN (12): the chart's two capabilities
CHART_CAPS = (1 << 21) | (1 << 12)


@dataclass(frozen=True)
class Row:
    step: str
    check: str
    ok: bool
    detail: str

    @property
    def result(self) -> str:
        return "PASS" if self.ok else "FAIL"


#: the story's steps in order: the name of their rows -> the method
STEPS = {
    "install": "install",
    "backends": "backends",
    "operate": "operate",
    "agent killed": "agent_killed",
    "backend moved": "backend_moved",
    "not ready": "not_ready",
    "uninstall": "uninstall",
    "upgrade from the previous release": "upgrade_from_previous",
    "upgrade between builds of main": "upgrade_main",
    "last uninstall": "last_uninstall",
}


@dataclass
class Rollout:
    """What a watcher saw of the agent's Pods during a rollout: the most nodes at once without a
    Ready agent, and the order in which the nodes got their new Pod."""

    most_unready: int = 0
    order: list[str] = field(default_factory=list)


@dataclass
class Story:
    lab: RealNodeLab
    previous: Release
    main: Release
    #: main again under another tag (the second build of main)
    main_b: Release
    say: Callable[[str], None] = print
    rows: list[Row] = field(default_factory=list)

    # -- bookkeeping ---------------------------------------------------------------------

    def row(self, step: str, check: str, ok: bool, detail: str) -> bool:
        self.rows.append(Row(step, check, ok, detail))
        self.say(f"{'PASS' if ok else 'FAIL'}  {step}: {check}: {detail}")
        return ok

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """A step whose error fails it (one row naming the error), not the story."""
        t0 = time.monotonic()
        self.say(f"---- {name}")
        try:
            yield
        except Exception as e:
            self.row(name, "completes", False, f"error: {type(e).__name__}: {e}")
        finally:
            self.save_logs(name)
        self.say(f"---- {name}: {time.monotonic() - t0:.0f}s")

    def save_logs(self, step: str) -> None:
        """The agents' logs (and their previous containers'), read through the API, into
        <workdir>/logs/<step>/: what an operator would read after a step."""
        where = (
            self.lab.workdir
            / "logs"
            / f"{len(self.rows):03d}-{step.split(':')[0].replace(' ', '-')}"
        )
        where.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(Exception):
            for p in self.agent_pods():
                name = p["metadata"]["name"]
                for extra in ((), ("--previous",)):
                    out = self.lab.kubectl("logs", "-n", AGENT_NAMESPACE, name, *extra, check=False)
                    if out.returncode == 0:
                        (where / f"{name}{'-previous' if extra else ''}.log").write_text(out.stdout)

    def run(self) -> list[Row]:
        """Every step in order (`STEPS`), each with its rows; a step that fails with an error
        says so in a row of its own, and the story goes on."""
        for name, method in STEPS.items():
            with self.step(name):
                getattr(self, method)()
        return self.rows

    # -- the agent -------------------------------------------------------------------------

    def agent_pods(self) -> list[Obj]:
        return self.lab.admin.list("Pod", AGENT_NAMESPACE, selector=AGENT_SELECTOR)

    def agent_pod(self, node: str) -> str:
        for p in self.agent_pods():
            if p["spec"].get("nodeName") == node and not p["metadata"].get("deletionTimestamp"):
                return str(p["metadata"]["name"])
        raise LookupError(f"no agent Pod on {node}")

    @staticmethod
    def _ready(pod: Obj) -> bool:
        conds = pod.get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

    def helm(self, *args: str, release: Release) -> None:
        values = [] if release.default_tag else ["--set", f"image.tag={release.tag}"]
        self.lab.helm(
            *args, RELEASE, str(release.chart), "-n", AGENT_NAMESPACE, *USER_VALUES, *values
        )

    def rollout(self, action: Callable[[], object]) -> Rollout:
        """Run `action` (helm install, upgrade or rollback), then `kubectl rollout status`, with
        a watcher of the agent's Pods meanwhile."""
        seen = Rollout()
        stop = threading.Event()
        before = {p["metadata"]["uid"] for p in self.agent_pods()}

        def watch() -> None:
            while not stop.is_set():
                with contextlib.suppress(Exception):
                    pods = [
                        p for p in self.agent_pods() if not p["metadata"].get("deletionTimestamp")
                    ]
                    ready = {p["spec"].get("nodeName") for p in pods if self._ready(p)}
                    seen.most_unready = max(seen.most_unready, len({n.name for n in NODES} - ready))
                    for p in pods:
                        node = p["spec"].get("nodeName")
                        if p["metadata"]["uid"] not in before and node and node not in seen.order:
                            seen.order.append(node)
                stop.wait(0.3)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            action()
            self.lab.kubectl(
                "-n",
                AGENT_NAMESPACE,
                "rollout",
                "status",
                f"daemonset/{RELEASE}",
                "--timeout=600s",
                timeout=660,
            )
        finally:
            stop.set()
            t.join()
        return seen

    def all_ready(self, tag: str) -> tuple[bool, str]:
        pods = self.agent_pods()
        on = {
            p["spec"].get("nodeName"): (self._ready(p), p["spec"]["containers"][0]["image"])
            for p in pods
            if not p["metadata"].get("deletionTimestamp")
        }
        ok = all(
            on.get(n.name, (False, ""))[0] and on[n.name][1].endswith(f":{tag}") for n in NODES
        )
        return ok, ", ".join(
            f"{n}: {'Ready' if r else 'not ready'} {i}" for n, (r, i) in sorted(on.items())
        )

    # -- 1. install --------------------------------------------------------------------------

    def install(self) -> None:
        """install: the README's commands install main's chart on two real nodes."""
        step = "install"  # STEPS: the name of each step's rows
        lab = self.lab
        # the README's own commands (Install), with the lab's image: what a user types
        image = {"REGISTRY/cozyebpf": AGENT_REPOSITORY, "TAG": self.main.tag}
        script = readme.filled(readme.blocks("Install"), **image)
        t0 = time.monotonic()
        self.rollout(lambda: lab.shell(script))
        ok, said = self.all_ready(self.main.tag)
        self.row(
            step,
            "the DaemonSet's Pods Ready on both nodes",
            ok,
            f"{said} ({time.monotonic() - t0:.0f}s)",
        )
        for n in NODES:
            pod = self.agent_pod(n.name)
            status = lab.kubectl(
                "exec", "-n", AGENT_NAMESPACE, pod, "--", "cat", "/proc/1/status"
            ).stdout
            fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
            eff, bnd = int(fields["CapEff"], 16), int(fields["CapBnd"], 16)
            seccomp, nnp = fields.get("Seccomp", "?").strip(), fields.get("NoNewPrivs", "?").strip()
            self.row(
                step,
                f"{n.name}: the agent runs with the chart's two capabilities, seccomp filtering",
                eff == CHART_CAPS and bnd == CHART_CAPS and seccomp == "2" and nnp == "1",
                f"CapEff {eff:#x} CapBnd {bnd:#x} (want {CHART_CAPS:#x}), Seccomp {seccomp}, "
                f"NoNewPrivs {nnp}",
            )
            on_node = probes.datapath(lab, n.name)
            self.row(
                step,
                f"{n.name}: XDP on eth0, maps pinned in the node's bpffs",
                on_node.attached,
                f"xdp {on_node.xdp}, {len(on_node.pins)} pins",
            )
        self.container_sees(step, NODES[0].name)
        self.readme_check(step)

    def readme_check(self, step: str) -> None:
        """The README's *Check that it works* commands, on each node: `cozyebpf status` in the
        agent's Pod, and its log saying the datapath is ready."""
        for n in NODES:
            script = readme.filled(readme.blocks("Check that it works"), NODE=n.name)
            try:
                out = self.lab.shell(script, timeout=120).stdout
                ok, said = "datapath ready" in out, f"{len(out.splitlines())} lines"
            except RuntimeError as e:
                ok, said = False, str(e)[-600:]
            self.row(step, f"{n.name}: the README's check commands answer", ok, said)

    #: what the agent reads of the kernel in its container, as a process on the node reads it
    KERNEL_FACTS = (
        "import os, cozyebpf.datapath.kernel as k; "
        "print(k.hz(), os.path.exists('/proc/config.gz'), "
        "bool(open('/proc/timer_list').read(64)), "
        "os.path.isdir('/boot') and bool(os.listdir('/boot')))"
    )

    def container_sees(self, step: str, node: str) -> None:
        """What a container hides of the kernel that a process on the node sees (the limits'
        clock reads the tick length from /proc/config.gz, /boot or /proc/timer_list), and
        whether the agent's reading of it is the same in both places."""
        pod = self.agent_pod(node)
        inside = self.lab.kubectl(
            "exec", "-n", AGENT_NAMESPACE, pod, "--", "python3", "-c", self.KERNEL_FACTS
        ).stdout.split()
        outside = subprocess.run(
            [*self.lab.node(node).enter(), sys.executable, "-c", self.KERNEL_FACTS],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        ).stdout.split()
        names = ("tick rate (CONFIG_HZ)", "/proc/config.gz", "/proc/timer_list readable", "/boot")
        self.row(
            step,
            "the agent reads the kernel's tick rate in its container as on the node",
            inside[0] == outside[0],
            "; ".join(
                f"{n}: {i} inside, {o} on the node"
                for n, i, o in zip(names, inside, outside, strict=True)
            ),
        )

    # -- 2. backends -------------------------------------------------------------------------

    def apply(self, *objs: Obj) -> None:
        self.lab.kubectl("apply", "-f", "-", input_=yaml.safe_dump_all(objs))

    def place_lbs(self) -> dict[str, str]:
        """The ToR's routes to the LB IPs, to the node of each backend (MetalLB's job)."""
        where = {}
        for app, lb in ((VM, LB_WHOLE), (WEB, LB_FILTERED)):
            pod = self.lab.admin.get("Pod", NAMESPACE, pod_name(self.lab, app))
            assert pod is not None
            where[app] = pod["spec"]["nodeName"]
            self.lab.route_lb(lb, where[app])
        return where

    def backends(self) -> None:
        """backends: a Deployment and a VM-like Pod behind port-filter and whole-IP Services."""
        step, lab = "backends", self.lab
        self.apply(namespace())
        self.apply(web_deployment(), vm_pod(NODES[0].name), *services())
        for name in (VM, WEB):
            lab.kubectl(
                "patch",
                "service",
                name,
                "-n",
                NAMESPACE,
                "--subresource=status",
                "--type=merge",
                "-p",
                json.dumps(lb_status(name)),
            )
        lab.kubectl(
            "-n",
            NAMESPACE,
            "wait",
            "--for=condition=Ready",
            "pod",
            "--all",
            "--timeout=120s",
            timeout=150,
        )
        where = self.place_lbs()
        # The Pods' Ready condition is the kubelet's; the slices follow it through the
        # endpointslice controller a moment later (CI once read "web" not ready right after
        # `kubectl wait` returned), so the check waits for the slices, not one read of them.
        ready: dict[str, list[tuple[str, bool, str]]] = {}

        def all_ready() -> bool:
            ready.clear()
            ready.update(probes.slices_ready(lab, NAMESPACE))
            return all(ready.get(a) and all(r for _, r, _ in ready[a]) for a in (VM, WEB))

        try:
            ok = wait_for(all_ready, 30, "the EndpointSlices to list the Pods Ready")
        except TimeoutError:
            ok = False
        self.row(
            step,
            "the EndpointSlices list the Pods Ready, from the kubelets' probes",
            ok,
            json.dumps(ready),
        )
        wait_for(
            lambda: "vm" in probes.http(lab, LB_WHOLE) and "web" in probes.http(lab, LB_FILTERED),
            60,
            "both LB IPs to answer",
        )
        for lb, app in ((LB_WHOLE, VM), (LB_FILTERED, WEB)):
            got = probes.http(lab, lb)
            self.row(
                step,
                f"HTTP to {app}'s LB IP reaches {app}, which sees the client",
                got.startswith(app) and CLIENT_IP in got,
                f"{got.strip()} (on {where[app]})",
            )
            got = probes.tcp(lab, lb, 7, b"tcp-echo\n")
            self.row(step, f"TCP echo through {app}'s LB IP", got == "tcp-echo\n", got.strip())
            got = probes.udp(lab, lb, 7, b"udp-echo")
            self.row(step, f"UDP echo through {app}'s LB IP", got == f"udp-echo from {lb}", got)
            ok, said = probes.ping(lab, lb)
            self.row(step, f"ICMP echo to {app}'s LB IP", ok and said.endswith(lb), said)
        got = probes.tcp(lab, LB_WHOLE, 81, b"x")
        self.row(
            step, "whole IP: a closed port is the Pod's to refuse", got == "connection refused", got
        )
        got = probes.tcp(lab, LB_FILTERED, 81, b"x")
        self.row(step, "port filter: a port not in spec.ports is dropped", got == "timeout", got)
        hub = EchoHub()
        try:
            hub.serve(lab.net, lab.client, socket.SOCK_STREAM, HUB_TCP)
            hub.serve(lab.net, lab.client, socket.SOCK_DGRAM, HUB_UDP)
            for app, lb in ((VM, LB_WHOLE), (WEB, LB_FILTERED)):
                pod = pod_name(lab, app)
                for proto, port in (("tcp", HUB_TCP), ("udp", HUB_UDP)):
                    ok, seen = probes.egress(lab, NAMESPACE, pod, proto, f"{CLIENT_IP}:{port}")
                    self.row(
                        step,
                        f"{app}'s {proto.upper()} egress leaves as its LB IP",
                        ok and seen == lb,
                        f"the client saw {seen}",
                    )
        finally:
            hub.close()

    # -- 3. operate ---------------------------------------------------------------------------

    def operate(self) -> None:
        """operate: the README's *Operate* commands `status` and `maps dump`, each as written
        (`[--json]`: without and with) in an agent's Pod through the API (exec); its logs; the
        Troubleshoot example."""
        step, lab = "operate", self.lab
        pod = self.agent_pod(self.node_of(NAMESPACE, VM))
        try:
            status, dump = (
                readme.forms(readme.inline("Operate", c))
                for c in ("cozyebpf status", "cozyebpf maps dump")
            )
        except LookupError as e:
            self.row(step, "the README's Operate commands", False, str(e))
            return
        runs = {
            c: lab.kubectl("exec", "-n", AGENT_NAMESPACE, pod, "--", *c.split(), check=False)
            for c in (*status, *dump)
        }
        for check, ok, said in readme.operated(status, dump, runs, (LB_WHOLE, LB_FILTERED)):
            self.row(step, f"kubectl exec ... {check}", ok, said)
        logs = lab.kubectl("logs", "-n", AGENT_NAMESPACE, pod).stdout
        self.row(
            step,
            "kubectl logs: the agent says its datapath is ready",
            "datapath ready" in logs,
            next((line for line in logs.splitlines() if "datapath ready" in line), logs[-200:]),
        )
        self.troubleshoot(step)

    def troubleshoot(self, step: str) -> None:
        """The README's *Troubleshoot* example on the node the port-filter Service's LB IP is
        routed to: its `cozyebpf explain` for a port not in spec.ports (443) answers as the
        README shows (the same lines, verdict and reason; the lab's Service), and its
        `cozyebpf monitor`, run while the client tries that port, shows the drop."""
        lab = self.lab
        pod = self.agent_pod(self.node_of(NAMESPACE, pod_name(lab, WEB)))
        exec_ = ("exec", "-n", AGENT_NAMESPACE, pod, "--")
        try:
            command, shown = readme.example("Troubleshoot", "cozyebpf explain")
            command = readme.filled(command, CLIENT=CLIENT_IP, LB_IP=LB_FILTERED)
            monitor = readme.inline("Troubleshoot", "cozyebpf monitor")
        except LookupError as e:
            self.row(step, "the README's Troubleshoot example", False, str(e))
            return
        p = lab.kubectl(*exec_, *command.split(), check=False)
        got = readme.parsed(p.stdout)
        service = f"{NAMESPACE}/{WEB}"
        ok = (
            p.returncode == 0
            and set(got) == set(shown)
            and (got.get("verdict"), got.get("reason")) == (shown["verdict"], shown["reason"])
            and got.get("service") == service
            and "443/tcp is not in spec.ports" in got.get("hint", "")
        )
        said = f"{p.stdout.strip()} {p.stderr.strip()[-300:]}".strip()
        self.row(step, f"kubectl exec ... {command}: as the README shows", ok, said)
        # the monitor, stopped by coreutils' timeout in the container, while the client tries
        # (every half second until then: however long the exec and the monitor's start take)
        out: list[subprocess.CompletedProcess[str]] = []
        watch = threading.Thread(
            target=lambda: out.append(
                lab.kubectl(*exec_, "timeout", "15", *monitor.split(), check=False, timeout=60)
            )
        )
        watch.start()
        end = time.monotonic() + 13
        while watch.is_alive() and time.monotonic() < end:
            probes.tcp(lab, LB_FILTERED, 443, b"x", timeout=0.5)
        watch.join(70)
        lines = [
            line
            for line in (out[0].stdout if out else "").splitlines()
            if "drop_port" in line and f"{LB_FILTERED}:443" in line and service in line
        ]
        said = lines[0] if lines else (out[0].stdout + out[0].stderr)[-400:] if out else "hung"
        self.row(step, f"kubectl exec ... {monitor}: the client's tries dropped", bool(lines), said)

    # -- 4. faults ----------------------------------------------------------------------------

    def agent_killed(self) -> None:
        """agent killed: the agent's process killed inside its container."""
        step, lab = "agent killed", self.lab
        node = NODES[0].name
        pod = self.agent_pod(node)
        before = lab.admin.get("Pod", AGENT_NAMESPACE, pod)
        assert before is not None
        restarts = before["status"]["containerStatuses"][0]["restartCount"]
        with streams(lab) as s:
            s.flowing()
            pid = lab.node(node).tasks()[
                before["status"]["containerStatuses"][0]["containerID"].split("//")[1]
            ]
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()

            def restarted() -> bool:
                p = lab.admin.get("Pod", AGENT_NAMESPACE, pod)
                return bool(
                    p
                    and p["status"]["containerStatuses"][0]["restartCount"] > restarts
                    and self._ready(p)
                )

            wait_for(restarted, 180, f"the kubelet to restart the agent of {pod}")
            back = time.monotonic() - t0
            s.flowing()
        self.row(
            step,
            "the kubelet restarted the agent; Ready again",
            True,
            f"in {back:.0f}s (pid {pid} killed)",
        )
        for check, ok, said in s.results():
            self.row(step, check, ok, said)
        logs = lab.kubectl("logs", "-n", AGENT_NAMESPACE, pod).stdout
        self.row(
            step,
            "the new process adopted the pinned maps",
            "adopted pinned maps" in logs,
            next((line for line in logs.splitlines() if "adopted" in line), logs[-200:]),
        )

    def backend_moved(self) -> None:
        """backend moved: a backend Pod deleted and rescheduled on the other node."""
        step, lab = "backend moved", self.lab
        old = pod_name(lab, WEB)
        old_node = self.node_of(NAMESPACE, old)
        lab.kubectl("cordon", old_node)
        try:
            lab.kubectl("delete", "pod", "-n", NAMESPACE, old, "--wait=false")

            def replaced() -> str:
                name = pod_name(lab, WEB)
                return name if name != old else ""

            new: str = wait_for(replaced, 60, "a new web Pod")
            lab.kubectl(
                "-n",
                NAMESPACE,
                "wait",
                "--for=condition=Ready",
                "pod",
                new,
                "--timeout=120s",
                timeout=150,
            )
        finally:
            lab.kubectl("uncordon", old_node)
        new_node = self.node_of(NAMESPACE, new)
        self.place_lbs()
        t0 = time.monotonic()

        def answered() -> str:
            h = probes.http(lab, LB_FILTERED)
            return h if h.startswith(new) else ""

        got: str = wait_for(answered, 60, f"{LB_FILTERED} to reach {new}")
        self.row(
            step,
            f"the LB IP reaches the new Pod on {new_node}",
            new_node != old_node,
            f"{got.strip()} after {time.monotonic() - t0:.1f}s (was {old} on {old_node})",
        )

    def not_ready(self) -> None:
        """not ready: a backend's readiness probe fails, then passes again."""
        step, lab = "not ready", self.lab
        lab.kubectl("exec", "-n", NAMESPACE, VM, "--", "/echo", "ready", "off")
        t0 = time.monotonic()
        try:
            wait_for(
                lambda: probes.udp(lab, LB_WHOLE, 7, b"x", timeout=0.5) == "timeout",
                60,
                f"{LB_WHOLE} to stop answering",
            )
            gone = time.monotonic() - t0
            said: list[str] = []

            def warned() -> list[str]:  # the agent's Events go out from a queue of their own
                said[:] = probes.warnings(lab, NAMESPACE, VM, "no ready endpoint")
                return said

            with contextlib.suppress(TimeoutError):
                wait_for(warned, 15, "the agent's Warning")
            self.row(
                step,
                "the Service leaves the datapath, with a Warning naming why",
                bool(said),
                f"after {gone:.1f}s: {said[:1]}",
            )
        finally:
            lab.kubectl("exec", "-n", NAMESPACE, VM, "--", "/echo", "ready", "on")
        t0 = time.monotonic()
        wait_for(
            lambda: probes.udp(lab, LB_WHOLE, 7, b"x", timeout=0.5) == f"x from {LB_WHOLE}",
            60,
            f"{LB_WHOLE} to answer again",
        )
        self.row(
            step, "ready again: the Service is back", True, f"after {time.monotonic() - t0:.1f}s"
        )

    # -- 5. uninstall -------------------------------------------------------------------------

    def detach_everywhere(self, tag: str) -> list[str]:
        """deploy/uninstall/uninstall.yaml with the image of `tag`, as the README says; the
        detach containers' logs."""
        lab = self.lab
        text = (REPO / "deploy" / "uninstall" / "uninstall.yaml").read_text()
        docs = [d for d in yaml.safe_load_all(text) if d]
        for d in docs:
            for c in [
                *d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []),
                *d.get("spec", {}).get("template", {}).get("spec", {}).get("initContainers", []),
            ]:
                if str(c.get("image", "")).startswith(AGENT_REPOSITORY + ":"):
                    c["image"] = f"{AGENT_REPOSITORY}:{tag}"
        lab.kubectl("apply", "-f", "-", input_=yaml.safe_dump_all(docs))
        lab.kubectl(
            "-n",
            AGENT_NAMESPACE,
            "rollout",
            "status",
            "daemonset/cozyebpf-uninstall",
            "--timeout=300s",
            timeout=330,
        )
        logs = lab.kubectl(
            "-n",
            AGENT_NAMESPACE,
            "logs",
            "-l",
            "app.kubernetes.io/name=cozyebpf-uninstall",
            "-c",
            "detach",
            "--prefix",
        ).stdout
        lab.kubectl("delete", "-f", "-", "--wait=true", input_=yaml.safe_dump_all(docs))
        return logs.splitlines()

    def uninstall(self, step: str = "uninstall", tag: str | None = None) -> None:
        """uninstall: helm uninstall, then the uninstall manifest's detach."""
        lab = self.lab
        lab.helm("uninstall", RELEASE, "-n", AGENT_NAMESPACE, "--wait")
        lab.kubectl(
            "-n",
            AGENT_NAMESPACE,
            "wait",
            "--for=delete",
            "pod",
            "-l",
            AGENT_SELECTOR,
            "--timeout=120s",
            timeout=150,
        )
        for n in NODES:
            d = probes.datapath(lab, n.name)
            self.row(
                step,
                f"{n.name}: after helm uninstall the datapath stays (fail-static)",
                d.attached,
                f"xdp {d.xdp}, {len(d.pins)} pins",
            )
        got = probes.udp(lab, LB_WHOLE, 7, b"still")
        self.row(step, "traffic still flows with no agent", got == f"still from {LB_WHOLE}", got)
        logs = self.detach_everywhere(tag or self.main.tag)
        for n in NODES:
            d = probes.datapath(lab, n.name)
            self.row(
                step,
                f"{n.name}: after the uninstall manifest nothing of cozyebpf is left",
                not d.xdp and not d.pins,
                f"xdp {d.xdp}, pins {d.pins}; {[line for line in logs if n.name in line][:2]}",
            )

    # -- 6. upgrades --------------------------------------------------------------------------

    def cycle(self, step: str, first: Release, second: Release, third: Release) -> None:
        """`first` installed (or running), then helm upgrade to `second`, then `third` (an
        upgrade, or a rollback when it is `first`), under traffic."""
        lab = self.lab
        with streams(lab) as s:
            s.flowing()
            for target, how in (
                (second, "upgrade"),
                (third, "rollback" if third is first else "upgrade"),
            ):
                t0 = time.monotonic()
                seen = self.rollout(self._changer(step, how, target))
                ok, said = self.all_ready(target.tag)
                self.row(
                    step,
                    f"helm {how} to {target.name}: one node at a time, every Pod Ready",
                    ok and seen.most_unready <= 1 and len(seen.order) == len(NODES),
                    f"{said}; nodes in turn {seen.order}, at most {seen.most_unready} without a "
                    f"Ready agent ({time.monotonic() - t0:.0f}s)",
                )
                try:  # every stream moves on again (a stream that broke does not: the rows say)
                    s.flowing(timeout=30)
                except TimeoutError as e:
                    self.row(
                        step, f"after helm {how} to {target.name}, traffic flows", False, str(e)
                    )
        for check, ok, said in s.results():
            self.row(step, check, ok, said)

    def _changer(self, step: str, how: str, target: Release) -> Callable[[], object]:
        if how == "rollback":
            return lambda: self.lab.helm("rollback", RELEASE, "-n", AGENT_NAMESPACE)
        return lambda: self.upgrade_as_readme(step, target)

    def upgrade_as_readme(self, step: str, target: Release) -> None:
        """helm upgrade to a build of main as the README's *Upgrade and roll back* writes it:
        main's chart packaged as a release's is (`helm package`: cozyebpf-X.Y.Z.tgz), TAG the
        build's image tag, the values installed with given nowhere again. Then a check that
        they were kept (the lab installs with agent.devices=eth0, the chart's default is auto)."""
        lab = self.lab
        out = lab.workdir / "main-chart"
        out.mkdir(exist_ok=True)
        p = lab.helm("package", str(target.chart), "-d", str(out))
        chart = p.stdout.strip().rpartition(": ")[2]
        lab.shell(readme.upgrade(chart, target.tag))
        values = json.loads(
            lab.helm("get", "values", RELEASE, "-n", AGENT_NAMESPACE, "--all", "-o", "json").stdout
        )
        kept = {"agent.devices": values["agent"]["devices"], "image.tag": values["image"]["tag"]}
        self.row(
            step,
            f"helm upgrade to {target.name} as the README writes it: the values installed "
            "with kept, the new tag taken",
            kept == {"agent.devices": "eth0", "image.tag": target.tag},
            json.dumps(kept),
        )

    def node_of(self, namespace: str, pod: str) -> str:
        obj = self.lab.admin.get("Pod", namespace, pod)
        if obj is None:
            raise LookupError(f"no Pod {namespace}/{pod}")
        return str(obj["spec"]["nodeName"])

    def upgrade_from_previous(self) -> None:
        """previous release: its chart and image, helm upgrade to main and rollback."""
        step, lab = "upgrade from the previous release", self.lab
        why = refused.refused_here(self.previous.tree) if self.previous.tree else None
        if why is not None:  # this kernel refuses its programs (cozylab/realnode/refused.py)
            return refused.upgrade_from_refused(self, why)
        seen = self.rollout(lambda: self.helm("install", release=self.previous))
        ok, said = self.all_ready(self.previous.tag)
        self.row(step, f"helm install of {self.previous.name}", ok and seen.most_unready <= 2, said)
        wait_for(
            lambda: probes.udp(lab, LB_WHOLE, 7, b"x", timeout=0.5) == f"x from {LB_WHOLE}",
            60,
            f"{self.previous.name} to program {LB_WHOLE}",
        )
        self.cycle(step, self.previous, self.main, self.previous)

    def upgrade_main(self) -> None:
        """main to main: helm upgrade between two builds of main, and rollback."""
        step = "upgrade between builds of main"
        self.rollout(lambda: self.upgrade_as_readme(step, self.main))
        self.cycle(step, self.main, self.main_b, self.main)

    def last_uninstall(self) -> None:
        """last uninstall: helm uninstall and detach after the upgrades."""
        self.uninstall("last uninstall", self.main.tag)
