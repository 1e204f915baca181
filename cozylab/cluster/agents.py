"""The agents: a real `cozyebpf run` per node, inside the node's namespace, with the arguments
and environment of the DaemonSet (deploy/daemonset.yaml, or the one `make image-test` renders
for the image under test), and what the lab reads from them (logs, pinned maps, counters)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cozylab.cluster.spec import NODES, node_ip, node_name
from cozylab.cluster.topology import Topology
from cozylab.netns import wait_for

REPO = Path(__file__).resolve().parents[2]


def daemonset_path() -> Path:
    """The DaemonSet whose container arguments and environment the agents run with: deploy/'s
    (rendered from charts/cozyebpf), or the one `make image-test` renders from the chart for
    the image under test (COZYEBPF_TEST_DAEMONSET, read when a lab starts, not at import)."""
    return Path(os.environ.get("COZYEBPF_TEST_DAEMONSET") or REPO / "deploy" / "daemonset.yaml")


def daemonset_container() -> dict[str, Any]:
    """The agent's container of the DaemonSet (`daemonset_path`)."""
    doc = yaml.safe_load(daemonset_path().read_text())
    container: dict[str, Any] = doc["spec"]["template"]["spec"]["containers"][0]
    return container


@dataclass
class NodeAgent:
    """One node's `cozyebpf run` (not cozyebpf.agent.Agent, which runs inside it)."""

    node: int
    ns: str
    pin_dir: str
    log_path: Path
    proc: subprocess.Popen[str] | None = None
    offset: int = 0  # where the current process's part of the log starts


#: where a pod's ServiceAccount volume is mounted, and the official client's in-cluster
#: configuration reads the token and the CA (a fixed path: kubernetes.config.incluster_config)
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def in_cluster_wrapper(identity: Path) -> list[str]:
    """A command prefix that runs the rest in a mount namespace of its own where `identity`
    (token, ca.crt, namespace) is bind-mounted on SERVICE_ACCOUNT_DIR, as the kubelet mounts a
    pod's ServiceAccount volume. The mount point is made once on the machine (an empty
    directory under /run); the mount itself is seen by that process alone."""
    os.makedirs(SERVICE_ACCOUNT_DIR, exist_ok=True)
    script = f'mount --bind -o ro "$0" {SERVICE_ACCOUNT_DIR} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(identity)]


class NodeAgents:
    """The agents of a lab's nodes: started, waited for, stopped, read. `identity`: per node,
    the ServiceAccount files of its agent's pod, and `api_env` the API server's address, set
    once the API runs: each agent finds the API as in a pod (in-cluster configuration)."""

    def __init__(
        self, topo: Topology, cmd: list[str], extra_args: list[str], workdir: Path
    ) -> None:
        self.topo = topo
        self.cmd = cmd
        self.extra_args = extra_args
        self.workdir = workdir
        self.identity: dict[int, Path] = {}
        self.api_env: dict[str, str] = {}
        self.by_node: dict[int, NodeAgent] = {}

    def pin_dir(self, n: int) -> str:
        return f"/sys/fs/bpf/{self.topo.prefix}-node{n}"

    def env(self, n: int) -> dict[str, str]:
        """The container environment of the DaemonSet (`daemonset_path`) for node n, the pin dir
        moved into the lab's (fieldRefs: spec.nodeName, status.hostIP; $(VAR) expanded)."""
        env: dict[str, str] = {}
        for e in daemonset_container().get("env", []):
            if "value" in e:
                env[e["name"]] = re.sub(
                    r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), str(e["value"])
                )
            else:
                ref = e["valueFrom"]["fieldRef"]["fieldPath"]
                env[e["name"]] = {"spec.nodeName": node_name(n), "status.hostIP": node_ip(n)}[ref]
        env["COZYEBPF_PIN_DIR"] = self.pin_dir(n)
        env.update(self.api_env)
        if self.topo.layout == "perpod":  # the DaemonSet's value for a CNI with per-pod veths
            env["COZYEBPF_RUN_POD_DEVICES"] = "lxc-*"
        return env

    def command(self) -> list[str]:
        """The DaemonSet's container arguments (`run`) and the extras."""
        return [*self.cmd, *daemonset_container()["args"], *self.extra_args]

    def start(self, n: int, wait: bool = True) -> None:
        assert n in self.identity and self.api_env, "the API runs before the agents"
        env = self.env(n)
        a = self.by_node.get(n) or NodeAgent(
            n, self.topo.node(n), env["COZYEBPF_PIN_DIR"], self.workdir / f"agent-node{n}.log"
        )
        self.by_node[n] = a
        a.offset = len(self.log(n)) if a.log_path.exists() else 0
        with a.log_path.open("a") as log:
            log.write(f"=== {' '.join(self.command())}\n")
            log.flush()
            a.proc = self.topo.lab.popen(
                a.ns,
                # killed with the lab's thread that started it: a lab killed by SIGKILL leaves
                # no agent running (util-linux setpriv; nsenter --net does not fork)
                *(["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []),
                *in_cluster_wrapper(self.identity[n]),
                *self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
            )
        if wait:
            self.wait(n)

    def log(self, n: int) -> str:
        a = self.by_node[n]
        return a.log_path.read_text() if a.log_path.exists() else ""

    def wait(self, n: int, timeout: float = 180) -> None:
        a = self.by_node[n]
        start = a.offset

        def ready() -> bool:
            if a.proc is not None and a.proc.poll() is not None:
                raise RuntimeError(
                    f"{node_name(n)}'s agent exited ({a.proc.returncode}):\n"
                    f"{self.log(n)[start:][-3000:]}"
                )
            return "datapath ready" in self.log(n)[start:]

        wait_for(ready, timeout, f"{node_name(n)}'s agent to attach")

    def lb_map(self, a: NodeAgent) -> dict[str, str]:
        """LB IP -> pod IP, as the agent's pinned maps hold them."""
        from cozyebpf.datapath.maps import PinnedMaps

        with PinnedMaps.open(a.pin_dir) as m:
            return {str(lb): str(e.pod_ip) for lb, e in m.read_state().services.items()}

    def wait_programmed(self, want: Mapping[str, str], timeout: float = 30) -> None:
        """Until every agent's maps hold `want` (LB IP -> pod IP)."""
        for a in self.by_node.values():
            wait_for(
                lambda a=a: all(self.lb_map(a).get(lb) == ip for lb, ip in want.items()),  # type: ignore[misc]
                timeout,
                lambda a=a: f"{node_name(a.node)}'s maps: {self.log(a.node)[-2000:]}",  # type: ignore[misc]
            )

    def stop(self, n: int, sig: int = signal.SIGTERM) -> int | None:
        a = self.by_node[n]
        if a.proc is None:
            return None
        a.proc.send_signal(sig)
        try:
            rc = a.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            a.proc.kill()
            rc = a.proc.wait()
        a.proc = None
        return rc

    def warnings(self, n: int, since: int = 0) -> list[str]:
        return [
            line
            for line in self.log(n)[since:].splitlines()
            if " WARNING " in line or " ERROR " in line
        ]

    def counted(self, reason: str) -> dict[str, int]:
        """Packets counted under `reason` per node (0 where the reason does not exist)."""
        from cozyebpf.datapath.maps import PinnedMaps

        out = {}
        for n, a in self.by_node.items():
            with PinnedMaps.open(a.pin_dir) as m:
                out[node_name(n)] = m.counters().get(reason, {}).get("packets", 0)
        return out

    def learned(self) -> dict[str, int]:
        """pass_learn packets per node (cumulative: the counters live as long as the pins)."""
        return self.counted("pass_learn")

    def kill(self) -> None:
        for n in list(self.by_node):
            with contextlib.suppress(Exception):
                self.stop(n, signal.SIGKILL)

    def detach(self) -> None:
        """Detach every agent's programs (`cozyebpf detach`), remove the pins."""
        for n, a in self.by_node.items():
            nsenter = self.topo.lab.nsenter(self.topo.node(n))
            subprocess.run(
                [*nsenter, *self.cmd, "detach", "--pin-dir", a.pin_dir],
                capture_output=True,
                timeout=60,
            )
        for n in NODES:
            shutil.rmtree(self.pin_dir(n), ignore_errors=True)
