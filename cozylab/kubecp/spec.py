"""The control plane's release, binaries, addresses and ports, and what the labs need of the
machine to run it (`missing_prerequisites`)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KUBE_GO_MOD = REPO / "cozylab" / "controlplane" / "kube" / "go.mod"
ETCD_GO_MOD = REPO / "cozylab" / "controlplane" / "etcd" / "go.mod"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")
#: what the real-node lab runs besides (cozylab/realnode/), built by the same script
NODE_BINARIES = ("kube-scheduler", "kubelet", "kube-proxy", "kubectl")

API_PORT = 6443
ETCD_PORT, ETCD_PEER_PORT = 2379, 2380
#: the Services' ClusterIPs (LoadBalancer Services get one too); only inside the lab
SERVICE_CIDR = "10.96.0.0/16"
FIRST_SERVICE_IP = "10.96.0.1"
ISSUER = "https://kubernetes.default.svc.cluster.local"
#: kube-controller-manager's controllers: the EndpointSlice controller and what it needs to
#: run as Kubernetes runs it (ServiceAccounts and their tokens, namespaces that can be deleted,
#: owner references that delete a Service's slices with it)
CONTROLLERS = (
    "endpointslice",
    "serviceaccount",
    "serviceaccount-token",
    "namespace",
    "garbagecollector",
)

Obj = dict[str, Any]


def kube_version() -> str:
    """The pinned Kubernetes release (k8s.io/kubernetes in cozylab/controlplane/kube/go.mod)."""
    m = re.search(r"^\s*k8s\.io/kubernetes (v\d+\.\d+\.\d+)", KUBE_GO_MOD.read_text(), re.M)
    if not m:
        raise RuntimeError(f"no k8s.io/kubernetes requirement in {KUBE_GO_MOD}")
    return m.group(1)


def etcd_version() -> str:
    m = re.search(r"go\.etcd\.io/etcd/server/v3 (v[\d.]+)", ETCD_GO_MOD.read_text())
    if not m:
        raise RuntimeError(f"no go.etcd.io/etcd/server/v3 requirement in {ETCD_GO_MOD}")
    return m.group(1)


def go_version() -> tuple[str, Path]:
    """The Go the control plane's build needs: the higher `go` line of the two modules'
    go.mod files, and that file (scripts/build-kube.sh reads it the same way)."""
    found = []
    for mod in (KUBE_GO_MOD, ETCD_GO_MOD):
        m = re.search(r"^go (\d+\.\d+(?:\.\d+)?)\s*$", mod.read_text(), re.M)
        if not m:
            raise RuntimeError(f"no go line in {mod}")
        found.append((tuple(int(x) for x in m.group(1).split(".")), m.group(1), mod))
    _, version, mod = max(found)
    return version, mod


@functools.cache
def bin_dir() -> Path:
    """Where scripts/build-kube.sh puts the binaries of this checkout's pins (it says so:
    --print-dir; the directory is named by the release and a stamp of what the build reads)."""
    out = subprocess.run(
        ["bash", str(REPO / "scripts" / "build-kube.sh"), "--print-dir"],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/build-kube.sh --print-dir: {out.stderr.strip()}")
    return Path(out.stdout.strip())


def missing_prerequisites(binaries: Sequence[str] = BINARIES) -> list[str]:
    """The binaries that are not built yet, with how to build them (or why their directory is
    unknown: build-kube.sh cannot say it without Go, e.g. in the Vagrant VM)."""
    try:
        d = bin_dir()
    except RuntimeError as e:
        return [str(e)]
    lacking = [b for b in binaries if not os.access(d / b, os.X_OK)]
    if not lacking:
        return []
    return [
        f"{', '.join(lacking)} of Kubernetes {kube_version()} in {d} (scripts/setup.sh --kube "
        "builds them from the Go module proxy: scripts/build-kube.sh)"
    ]
