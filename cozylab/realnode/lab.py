"""The real-node lab (`RealNodeLab`): the control plane, two real nodes, the ToR and a client, and
what a user does to them with the real tools (helm, kubectl)."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cozylab.kubecp import ControlPlane, Kube
from cozylab.kubecp.spec import CONTROLLERS, Obj
from cozylab.netns import Lab, run, wait_for
from cozylab.realnode import images as lab_images
from cozylab.realnode.cgroups import Subtree
from cozylab.realnode.node import FIXED_DIRS, Node
from cozylab.realnode.spec import (
    API_IP,
    CLIENT_GW,
    CLIENT_IP,
    CLIENT_PREFIX,
    KUBELET_SYSCTLS,
    NODES,
    RUN_ROOT,
    SEGMENT_PREFIX,
    STATE_ROOT,
    TOR_IP,
    kube_bin,
    missing_prerequisites,
)

REPO = Path(__file__).resolve().parents[2]

#: kube-controller-manager's controllers: the control-plane labs' and what workloads on nodes
#: need (DaemonSets, Deployments and their ReplicaSets, the CA bundle every namespace's Pods
#: mount, the garbage collection of terminated Pods, the Nodes' lifecycle: the not-ready taint a
#: kubelet registers with is lifted by it, and Pods leave a node that stops answering)
CONTROLLERS_WITH_WORKLOADS = (
    *CONTROLLERS,
    "daemonset",
    "deployment",
    "replicaset",
    "root-ca-cert-publisher",
    "podgc",
    "nodelifecycle",
    "taint-eviction-controller",
)
#: the nodes' pod ranges together (kube-proxy's cluster CIDR)
CLUSTER_CIDR = "198.51.100.128/26"


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys") / key.replace(".", "/")


def ours(
    cmd: str,
    cwd: str,
    cgroups: str,
    net: str,
    dirs: Sequence[str],
    cgroup_rel: str,
    netns: set[str],
) -> bool:
    """Whether a process is a lab's: its working directory is under one of `dirs` or its
    command line names one, or one of its cgroups (/proc/<pid>/cgroup) is in the subtree
    `cgroup_rel`, or its network namespace (/proc/<pid>/ns/net, "net:[<inode>]") is in `netns`."""
    if any(cwd == d or cwd.startswith(f"{d}/") for d in dirs):
        return True
    if any(re.search(re.escape(d) + r"(?=[/\s]|$)", cmd) for d in dirs):
        return True
    top = f"/{cgroup_rel.strip('/')}"
    for line in cgroups.splitlines():
        path = line.split(":", 2)[-1]
        if path == top or path.startswith(f"{top}/"):
            return True
    return net in netns


class RealNodeLab:
    """`<prefix>-tor` (br0 on the nodes' segment 192.0.2.0/24, the client's side
    198.51.100.0/25), `<prefix>-client`, `<prefix>-cp` (the control plane with kube-scheduler),
    `<prefix>-node1` and `-node2` (real nodes: `Node`)."""

    def __init__(self, prefix: str, workdir: Path, log: Callable[[str], None] = print) -> None:
        self.prefix = prefix
        self.workdir = workdir
        self.say = log
        self.net = Lab(prefix, pods=())  # the namespace helpers (ip, exec, sockets)
        self.tor = f"{prefix}-tor"
        self.client = f"{prefix}-client"
        self.cgroups = Subtree(prefix)
        self.plane = ControlPlane(
            prefix,
            workdir / "cp",
            API_IP,
            log=log,
            controllers=CONTROLLERS_WITH_WORKLOADS,
            scheduler=True,
        )
        self.nodes = [
            Node(prefix, s, self.plane, self.cgroups, CLUSTER_CIDR, workdir / s.name, log)
            for s in NODES
        ]
        self._sysctls: dict[str, str] = {}
        #: the machine's values of the kubelet's sysctls when the lab came up
        self._before: dict[str, str] = {}
        #: the fixed directories (FIXED_DIRS) that the machine had before the lab
        self._fixed_before: set[str] = set(FIXED_DIRS)
        self._made_dirs: list[Path] = []
        self.timings: dict[str, float] = {}

    @property
    def namespaces(self) -> list[str]:
        return [self.tor, self.client, *(n.ns for n in self.nodes)]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # -- up and down ---------------------------------------------------------------------

    def up(self, agent_images: Sequence[Path] = ()) -> RealNodeLab:
        missing = missing_prerequisites()
        if missing:
            raise RuntimeError(f"the real-node lab needs {'; '.join(missing)}")
        t0 = time.monotonic()
        self.down()
        try:
            self._network()
            self._save_sysctls()
            self.plane.start()
            self.plane.attach(self.tor, "br0", SEGMENT_PREFIX)
            self.timings["control plane"] = time.monotonic() - t0
            base = lab_images.lab_images()
            self._fixed_before = {d for d in FIXED_DIRS if Path(d).exists()}
            for fixed in FIXED_DIRS:
                if not Path(fixed).exists():
                    Path(fixed).mkdir(parents=True)
                    self._made_dirs.append(Path(fixed))
            for n in self.nodes:
                n.start_runtime()
            self.import_images([*base, *agent_images])
            for n in self.nodes:
                n.start_kubelet()
            for n in self.nodes:
                self._wait_ready(n)
            self.timings["nodes ready"] = time.monotonic() - t0
        except BaseException:
            if not os.environ.get("COZYLAB_KEEP"):
                self.down()
            raise
        self.say(
            f"real-node lab up in {time.monotonic() - t0:.1f}s: "
            + ", ".join(f"{k} {v:.1f}s" for k, v in self.timings.items())
        )
        return self

    def _wait_ready(self, n: Node) -> None:
        def ready() -> bool:
            return self.node_ready(n.name)

        wait_for(ready, 120, lambda: f"Node {n.name} Ready: {n.tail('kubelet')}")

    def import_images(self, archives: Sequence[Path]) -> None:
        """Import image archives into every node's containerd, the nodes side by side."""
        errors: list[BaseException] = []

        def each(n: Node) -> None:
            try:
                for a in archives:
                    n.import_image(a)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=each, args=(n,)) for n in self.nodes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def tag_image(self, src: str, dst: str) -> None:
        """Name an image that every node has by another name too (`ctr images tag`)."""
        for n in self.nodes:
            n.ctr("images", "tag", "--force", src, dst)

    def down(self) -> None:
        """Stop everything the lab started and remove what it made: the nodes (kubelets first,
        then the Pods' containers, containerd, what is left in the lab's cgroups), the control
        plane, the namespaces, the cgroups, the directories; the sysctls the kubelet set are
        restored. Raises if a mount of the lab's is left in the machine's mount namespace."""
        for n in self.nodes:
            with contextlib.suppress(Exception):
                n.stop()
        self.cgroups.remove()
        self.plane.stop()
        existing = run("ip", "netns", "list", check=False).stdout.split()
        for ns in [*self.namespaces, self.plane.ns]:
            if ns in existing:
                run("ip", "netns", "del", ns, check=False)
        self._restore_sysctls()
        left = self.lab_mounts()
        if left:
            raise RuntimeError(f"mounts of the lab left on the machine: {left}")
        for d in (STATE_ROOT / self.prefix, RUN_ROOT / self.prefix):
            if d.exists():
                run("rm", "-rf", "--one-file-system", str(d))
            with contextlib.suppress(OSError):
                d.parent.rmdir()  # if no other lab uses it
        for d in self._made_dirs:
            with contextlib.suppress(OSError):
                d.rmdir()
        self._made_dirs.clear()

    def leftovers(self) -> dict[str, list[str]]:
        """What of the lab is still on the machine (after `down`, every list is empty): its
        processes (`processes`), its cgroups, its mounts, its namespaces, the directories it made
        at fixed paths, the sysctls the kubelet set that differ from before."""
        procs = [f"{pid} {cmd[:120]}" for pid, cmd in self.processes()]
        existing = run("ip", "netns", "list", check=False).stdout.split()
        return {
            "processes": procs,
            "cgroups": [str(d) for d in self.cgroups.existing()],
            "mounts": self.lab_mounts(),
            "namespaces": [ns for ns in [*self.namespaces, self.plane.ns] if ns in existing],
            "directories": [
                str(d)
                for d in (STATE_ROOT / self.prefix, RUN_ROOT / self.prefix, *map(Path, FIXED_DIRS))
                if d.exists() and str(d) not in self._fixed_before
            ],
            "sysctls": [
                f"{k} = {_sysctl_path(k).read_text().strip()} (was {v})"
                for k, v in self._before.items()
                if _sysctl_path(k).read_text().strip() != v
            ],
        }

    def processes(self) -> list[tuple[int, str]]:
        """The machine's processes that are the lab's (pid and command line): those started in
        one of its directories or naming one, those in its cgroup subtree, those in one of its
        network namespaces that are still there. Another lab's processes are not: the cluster
        lab runs the same Kubernetes binaries beside this one in CI, from directories, cgroups
        and namespaces of its own. (A namespace deleted by `down` is not looked for: the kernel
        gives its inode number to the next namespace made, and a CI run found another test's
        agent in one. The lab's daemons and Pods are in its cgroup subtree anyway.)"""
        dirs = tuple(
            str(d) for d in (self.workdir, STATE_ROOT / self.prefix, RUN_ROOT / self.prefix)
        )
        netns = set()
        for ns in [*self.namespaces, self.plane.ns]:
            with contextlib.suppress(OSError):
                netns.add(f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]")
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                cwd = os.readlink(proc / "cwd")
                cgroups = (proc / "cgroup").read_text()
                net = os.readlink(proc / "ns" / "net")
            except OSError:
                continue
            if ours(cmd, cwd, cgroups, net, dirs, self.cgroups.rel, netns):
                found.append((int(proc.name), cmd.strip()))
        return found

    def lab_mounts(self) -> list[str]:
        """The machine's mounts (its own mount namespace) under the lab's directories."""
        out = run("findmnt", "-rno", "TARGET", check=False).stdout.split()
        roots = (str(STATE_ROOT / self.prefix), str(RUN_ROOT / self.prefix), *FIXED_DIRS)
        return [m for m in out if m.startswith(roots)]

    def __enter__(self) -> RealNodeLab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _save_sysctls(self) -> None:
        for key in KUBELET_SYSCTLS:
            p = _sysctl_path(key)
            if p.exists() and key not in self._sysctls:
                self._sysctls[key] = p.read_text().strip()
        self._before = dict(self._sysctls)

    def _restore_sysctls(self) -> None:
        for key, value in self._sysctls.items():
            p = _sysctl_path(key)
            if p.read_text().strip() != value:
                p.write_text(value)
        self._sysctls.clear()

    def _network(self) -> None:
        net, tor, client = self.net, self.tor, self.client
        for ns in self.namespaces:
            net.add_namespace(ns)
        net.sysctl(tor, "net.ipv4.ip_forward", "1")
        net.ip(tor, "link", "add", "br0", "type", "bridge")
        net.ip(tor, "addr", "add", f"{TOR_IP}/{SEGMENT_PREFIX}", "dev", "br0")
        net.ip(tor, "link", "set", "br0", "up")
        run(
            "ip",
            "-n",
            tor,
            "link",
            "add",
            "ext",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            client,
        )
        net.ip(tor, "addr", "add", f"{CLIENT_GW}/{CLIENT_PREFIX}", "dev", "ext")
        net.ip(tor, "link", "set", "ext", "up")
        net.ip(client, "addr", "add", f"{CLIENT_IP}/{CLIENT_PREFIX}", "dev", "eth0")
        net.ip(client, "link", "set", "eth0", "up")
        net.ip(client, "route", "add", "default", "via", CLIENT_GW)
        for n in self.nodes:
            port = f"sw-{n.name}"
            run(
                "ip",
                "-n",
                tor,
                "link",
                "add",
                port,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                n.ns,
            )
            net.ip(tor, "link", "set", port, "master", "br0", "up")
            net.sysctl(n.ns, "net.ipv4.ip_forward", "1")
            net.ip(n.ns, "addr", "add", f"{n.spec.ip}/{SEGMENT_PREFIX}", "dev", "eth0")
            net.ip(n.ns, "link", "set", "eth0", "up")
            net.ip(n.ns, "route", "add", "default", "via", TOR_IP)
            net.ip(tor, "route", "add", n.spec.pod_cidr, "via", n.spec.ip)

    # -- the cluster -----------------------------------------------------------------------

    @property
    def admin(self) -> Kube:
        return self.plane.admin

    def node_ready(self, name: str) -> bool:
        node = self.admin.get("Node", None, name)
        if node is None:
            return False
        conds = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        return conds.get("Ready") == "True"

    def tool_env(self) -> dict[str, str]:
        """The environment of kubectl and helm: the lab admin's kubeconfig, and helm's own
        directories in the lab's work directory (nothing of the machine's)."""
        helm = self.workdir / "helm"
        return {
            **os.environ,
            "KUBECONFIG": str(self.plane.workdir / "admin.kubeconfig"),
            "HELM_CACHE_HOME": str(helm / "cache"),
            "HELM_CONFIG_HOME": str(helm / "config"),
            "HELM_DATA_HOME": str(helm / "data"),
        }

    def _tool(
        self, argv: list[str], check: bool, timeout: float, input_: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a client tool inside the control plane's namespace (the API server at
        127.0.0.1:6443)."""
        if not (self.plane.workdir / "admin.kubeconfig").exists():
            self.plane.kubeconfig("admin", "admin", "https://127.0.0.1:6443")
        p = subprocess.run(
            ["nsenter", f"--net=/run/netns/{self.plane.ns}", *argv],
            capture_output=True,
            text=True,
            env=self.tool_env(),
            timeout=timeout,
            input=input_,
        )
        if check and p.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed ({p.returncode}): {p.stdout.strip()} {p.stderr.strip()}"
            )
        return p

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 120, input_: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return self._tool([str(kube_bin("kubectl")), *args], check, timeout, input_)

    def helm(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        return self._tool([str(REPO / ".venv" / "bin" / "helm"), *args], check, timeout)

    def shell(self, script: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        """`script` run by bash (-e, pipefail) where kubectl and helm run, from the checkout
        (relative paths as the README's), with the lab's kubectl and helm first on PATH."""
        tools = f"{kube_bin('kubectl').parent}:{REPO / '.venv' / 'bin'}"
        argv = ["env", f"PATH={tools}:{os.environ.get('PATH', '')}", "bash", "-eo", "pipefail"]
        return self._tool([*argv, "-c", f"cd {REPO}\n{script}"], True, timeout)

    def pods(self, namespace: str, selector: str = "") -> list[Obj]:
        return (
            self.admin.list("Pod", namespace, selector=selector)
            if selector
            else self.admin.list("Pod", namespace)
        )

    def pod_netns(self, namespace: str, name: str) -> str:
        """The network namespace of a running Pod, as a path a lab socket can enter
        (/proc/<pid>/ns/net of its first container's process, on its node)."""
        pod = self.admin.get("Pod", namespace, name)
        if pod is None:
            raise LookupError(f"no Pod {namespace}/{name}")
        node = self.node(pod["spec"]["nodeName"])
        statuses = pod.get("status", {}).get("containerStatuses") or []
        ids = [s["containerID"].split("//", 1)[1] for s in statuses if s.get("containerID")]
        tasks = node.tasks()
        for cid in ids:
            if cid in tasks:
                return f"/proc/{tasks[cid]}/ns/net"
        raise LookupError(f"Pod {namespace}/{name} has no running container on {node.name}")

    def route_lb(self, lb_ip: str, node: str) -> None:
        """The ToR's route to `lb_ip` via `node` (what MetalLB's announcement makes the
        network do: the lab writes it, as the cluster lab's speaker answers ARP)."""
        self.net.ip(self.tor, "route", "replace", f"{lb_ip}/32", "via", self.node(node).spec.ip)

    def describe(self) -> str:
        """What an operator would look at when something is wrong: nodes, pods, events."""
        out = []
        for args in (
            ("get", "nodes", "-o", "wide"),
            ("get", "pods", "-A", "-o", "wide"),
            ("get", "events", "-A"),
        ):
            p = self.kubectl(*args, check=False)
            out.append(f"$ kubectl {' '.join(args)}\n{p.stdout}{p.stderr}")
        return "\n".join(out)
