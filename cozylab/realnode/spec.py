"""The real-node lab's addresses, names, directories and versions, and what it needs of the
machine (`missing_prerequisites`)."""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cozylab.kubecp.spec import NODE_BINARIES
from cozylab.kubecp.spec import bin_dir as kube_bin_dir
from cozylab.kubecp.spec import missing_prerequisites as kube_missing

REPO = Path(__file__).resolve().parents[2]

# -- the network (documentation ranges only, inside the lab's namespaces) -------------------
#: the nodes' segment: node i is .i, the control plane .250, the ToR .254
SEGMENT_PREFIX = 24
API_IP = "192.0.2.250"
TOR_IP = "192.0.2.254"
#: the client, behind the ToR
CLIENT_IP = "198.51.100.2"
CLIENT_GW = "198.51.100.1"
CLIENT_PREFIX = 25
#: the LB IPs (the ToR routes each to the node of its backend, as MetalLB's announcement
#: would make it: the lab writes those routes)
LB_WHOLE = "203.0.113.10"
LB_FILTERED = "203.0.113.20"
#: the Services' ClusterIPs (kube-proxy's, in each node: the kubernetes Service)
SERVICE_CIDR = "10.96.0.0/16"


@dataclass(frozen=True)
class NodeSpec:
    """One node: its Kubernetes name, its address on the segment, its pod range (the bridge
    CNI's host-local range, routed to it by the ToR)."""

    index: int

    @property
    def name(self) -> str:
        return f"node{self.index}"

    @property
    def ip(self) -> str:
        return f"192.0.2.{self.index}"

    @property
    def pod_cidr(self) -> str:
        return f"198.51.100.{96 + 32 * self.index}/27"

    @property
    def pod_gw(self) -> str:
        return f"198.51.100.{96 + 32 * self.index + 1}"


NODES = (NodeSpec(1), NodeSpec(2))

# -- the images (no registry: built here, imported into each node's containerd) -------------
#: the sandbox image, named in containerd's configuration (kubelet v1.34 leaves it to the runtime)
PAUSE_IMAGE = "localhost/cozylab/pause:3.10.1"
#: the backends' image (cozylab/images/echo)
ECHO_IMAGE = "localhost/cozylab/echo:1"
#: the chart's image repository (charts/cozyebpf/values.yaml): the images built here take its
#: name, so that `helm install` needs no image value for a release
AGENT_REPOSITORY = "ghcr.io/cozystack/cozyebpf"

# -- the machine ----------------------------------------------------------------------------
#: everything a lab writes: <STATE_ROOT>/<prefix>/<node>/ (containerd's root, the kubelet's,
#: logs), <RUN_ROOT>/<prefix>/<node>/ (sockets, containerd's state), and one cgroup per v1
#: controller, /<CGROUP_ROOT>/<prefix>/...
STATE_ROOT = Path("/var/lib/cozylab-realnode")
RUN_ROOT = Path("/run/cozylab-realnode")
CGROUP_ROOT = "cozylab-realnode"
CGROUP_FS = Path("/sys/fs/cgroup")
#: where the node's binaries (containerd, runc, the pause and echo binaries) and images go
NODE_CACHE = Path(os.environ.get("COZYEBPF_NODE_CACHE") or "/var/cache/cozyebpf/node")
RUNTIME_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "pause", "echo")
#: the standard CNI plugins (Debian's containernetworking-plugins)
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_PLUGINS = ("bridge", "host-local", "loopback")
#: the sysctls the kubelet sets at start (pkg/kubelet/cm, setupKernelTunables; not per network
#: namespace): the lab restores what the machine had
KUBELET_SYSCTLS = (
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
)


def runtime_versions() -> dict[str, str]:
    """containerd's, runc's and pause's versions, as scripts/build-node.sh built them."""
    text = (node_bin_dir() / "versions").read_text()
    return dict(line.split("=", 1) for line in text.split())


@functools.cache
def node_bin_dir() -> Path:
    """Where scripts/build-node.sh puts the node's binaries for this checkout's pins."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-node.sh"), "--print-dir"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/build-node.sh --print-dir: {out.stderr.strip()}")
    return Path(out.stdout.strip())


def kube_bin(name: str) -> Path:
    return kube_bin_dir() / name


def missing_prerequisites() -> list[str]:
    """What the lab needs and the machine lacks, each with how to get it."""
    missing = kube_missing((*NODE_BINARIES, "etcd", "kube-apiserver", "kube-controller-manager"))
    try:
        d = node_bin_dir()
    except RuntimeError as e:  # build-node.sh cannot say where without Go
        return [*missing, str(e)]
    lacking = [b for b in RUNTIME_BINARIES if not os.access(d / b, os.X_OK)]
    if lacking:
        missing.append(
            f"{', '.join(lacking)} in {d} (scripts/setup.sh --real-node builds them: "
            "scripts/build-node.sh)"
        )
    plugins = [p for p in CNI_PLUGINS if not os.access(CNI_BIN_DIR / p, os.X_OK)]
    if plugins:
        missing.append(
            f"the CNI plugins {', '.join(plugins)} in {CNI_BIN_DIR} (Debian's "
            "containernetworking-plugins; scripts/setup.sh --real-node installs it)"
        )
    return missing
