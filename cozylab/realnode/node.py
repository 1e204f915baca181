"""One real node (`Node`): a network namespace and a mount namespace of its own, in which its own
containerd, kubelet and kube-proxy run, each with its own root, state and socket directories.

- The network namespace `<prefix>-<node>` has the node's uplink eth0 (the lab wires it to the
  ToR) and the CNI's bridge cni0. A hostNetwork Pod (the chart's DaemonSet) runs in it: runc
  gives such a Pod no network namespace, so it shares that of the shim that this node's
  containerd started here.
- The mount namespace is a slave of the machine's: the machine's mounts appear in it, and what
  containerd and the kubelet mount (overlays, the Pods' volumes, their network namespaces) stays
  in it and goes with it. It has a bpffs of its own at /sys/fs/bpf, as every machine has (both
  nodes share one kernel here: with one bpffs, the chart's default pin directory would be the
  same for both, and the second node's agent would adopt the first one's maps). The pins go with
  the node; from outside, `Node.enter()` reaches them. Inside, every mount is then made shared,
  as systemd leaves a node's (this machine has no systemd: its mounts are private, and
  containerd refuses the chart's bpffs volume, HostToContainer, on a private mount). The
  directories that containerd's CNI library, the kubelet and containerd's shims write at fixed
  paths, /var/lib/cni (libcni's cache), /var/log/containers (the kubelet's links to the logs)
  and /run/containerd (the shims' sockets), are the node's own directories bind-mounted there,
  inside.
- Every process is in the lab's cgroup subtree (`Subtree`): the daemons in <node>/system, the
  Pods under the kubelet's --cgroup-root <node> (cgroupfs driver, as containerd's).
- Identity: the kubelet's client certificate is system:node:<node> (the Node authorizer and
  NodeRestriction admit it), its serving certificate is the lab CA's (the API server checks it:
  exec and logs through the API), kube-proxy's is system:kube-proxy.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from cozylab.kubecp import ControlPlane
from cozylab.kubecp.spec import API_PORT
from cozylab.netns import wait_for
from cozylab.realnode.cgroups import Subtree
from cozylab.realnode.spec import (
    API_IP,
    CNI_BIN_DIR,
    PAUSE_IMAGE,
    RUN_ROOT,
    STATE_ROOT,
    NodeSpec,
    kube_bin,
    node_bin_dir,
)

#: directories the node's components write at fixed paths: the node's own, bind-mounted there
#: inside its mount namespace (the mount points are made on the machine if missing, and removed
#: again by the lab when it made them and they are empty)
FIXED_DIRS = ("/var/lib/cni", "/var/log/containers", "/run/containerd")


class Node:
    """containerd, kubelet and kube-proxy of one node, in `ns` (made and wired by the lab)."""

    def __init__(
        self,
        prefix: str,
        spec: NodeSpec,
        plane: ControlPlane,
        cgroups: Subtree,
        cluster_cidr: str,
        logdir: Path,
        log: Callable[[str], None] = lambda s: None,
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.ns = f"{prefix}-{spec.name}"
        self.state = STATE_ROOT / prefix / spec.name
        self.run = RUN_ROOT / prefix / spec.name
        #: the components' logs (kept after the lab, unlike `state`)
        self.logdir = logdir
        self.plane = plane
        self.cgroups = cgroups
        self.cluster_cidr = cluster_cidr
        self.say = log
        self.bin = node_bin_dir()
        self.holder: subprocess.Popen[bytes] | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # -- paths ---------------------------------------------------------------------------

    @property
    def sock(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.state / "kubelet"

    def log_path(self, name: str) -> Path:
        self.logdir.mkdir(parents=True, exist_ok=True)
        return self.logdir / f"{name}.log"

    def tail(self, name: str, chars: int = 3000) -> str:
        p = self.log_path(name)
        return p.read_text(errors="replace")[-chars:] if p.exists() else "(no log)"

    # -- up and down ---------------------------------------------------------------------

    def start_runtime(self) -> None:
        """Write the node's configuration and start containerd. From the thread that stays (the
        daemons die with the thread that started them: setpriv --pdeathsig)."""
        for d in (self.state, self.run, self.state / "cni" / "net.d", self.state / "pod-logs"):
            d.mkdir(parents=True, exist_ok=True)
        for fixed in FIXED_DIRS:
            (self.state / "fixed" / fixed.strip("/")).mkdir(parents=True, exist_ok=True)
        self.cgroups.make(f"{self.name}/system")
        self.cgroups.make(self.name)
        self._pki()
        self._cni_config()
        self._containerd_config()
        self._kubelet_config()
        self._kube_proxy_config()
        self._start_holder()
        self._start(
            "containerd",
            [str(self.bin / "containerd"), "--config", str(self.state / "containerd.toml")],
        )
        wait_for(
            lambda: self._alive("containerd") and self.sock.exists(),
            30,
            lambda: f"{self.name}'s containerd: {self.tail('containerd')}",
        )

    def start_kubelet(self) -> None:
        """Start the kubelet and kube-proxy (the lab waits for the Node to be Ready)."""
        self._start("kubelet", self._kubelet_argv())
        self._start("kube-proxy", self._kube_proxy_argv())

    def stop(self) -> None:
        """Stop the kubelet and kube-proxy, stop every Pod's containers through containerd, stop
        containerd, kill what is left of the node (shims, containers) in the lab's cgroups, and
        the mount namespace's holder: its mounts go with it."""
        for name in ("kube-proxy", "kubelet"):
            self._stop(name)
        if self._alive("containerd"):
            for task in self.tasks():
                self.ctr("tasks", "kill", "--signal", "SIGKILL", task, check=False)
        self._stop("containerd")
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()
            self.holder = None

    def _alive(self, name: str) -> bool:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            raise RuntimeError(f"{self.name}'s {name} exited: {self.tail(name)}")
        return True

    def running(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def _start_holder(self) -> None:
        binds = "; ".join(
            f"mount --bind {self.state / 'fixed' / d.strip('/')} {d}" for d in FIXED_DIRS
        )
        self.holder = subprocess.Popen(
            [
                *("nsenter", f"--net=/run/netns/{self.ns}"),
                *self._pdeathsig(),
                *self.cgroups.wrapper(f"{self.name}/system"),
                *("unshare", "--mount", "--propagation", "slave"),
                # A node with systemd has every mount shared (systemd makes / rshared at boot):
                # containerd refuses a hostPath with HostToContainer propagation (the chart's
                # bpffs) that is neither shared nor slave. This machine has no systemd, so its
                # mounts are private: the node's copies are made rshared here, inside (a slave of
                # the machine's first, so nothing propagates back out).
                # Each node has a bpffs of its own, as a machine has: one kernel runs both nodes
                # here, and the chart's default pin directory (/sys/fs/bpf/cozyebpf) in one
                # bpffs would have the second node's agent adopt the first one's maps.
                *(
                    "sh",
                    "-c",
                    f"set -e; {binds}; mount -t bpf bpf /sys/fs/bpf; mount --make-rshared /; "
                    "exec sleep infinity",
                ),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.log_path("holder").open("ab"),
        )

        def mount_ns_ready() -> bool:
            assert self.holder is not None
            if self.holder.poll() is not None:
                raise RuntimeError(f"{self.name}'s mount namespace: {self.tail('holder')}")
            mine = Path("/proc/self/ns/mnt").readlink()
            comm = Path(f"/proc/{self.holder.pid}/comm").read_text().strip()
            return comm == "sleep" and Path(f"/proc/{self.holder.pid}/ns/mnt").readlink() != mine

        wait_for(mount_ns_ready, 10, f"{self.name}'s mount namespace")

    @staticmethod
    def _pdeathsig() -> list[str]:
        # killed with the thread that started it: a lab killed by SIGKILL leaves no daemon
        return ["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []

    def enter(self) -> list[str]:
        """A command prefix that runs the rest in the node's namespaces (network and mount)."""
        assert self.holder is not None, f"{self.name} is not started"
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--net"]

    def _start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        with self.log_path(name).open("ab") as out:
            out.write(f"=== {' '.join(argv)}\n".encode())
            out.flush()
            p = subprocess.Popen(
                [
                    *self.enter(),
                    *self._pdeathsig(),
                    *self.cgroups.wrapper(f"{self.name}/system"),
                    *argv,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.state,
            )
        self.procs[name] = p
        return p

    def _stop(self, name: str, timeout: float = 20) -> None:
        p = self.procs.pop(name, None)
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def restart_kubelet(self) -> None:
        self._stop("kubelet")
        self._start("kubelet", self._kubelet_argv())

    # -- containerd ------------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        """`ctr` against this node's containerd, in the CRI's namespace (k8s.io)."""
        p = subprocess.run(
            [
                *self.enter(),
                str(self.bin / "ctr"),
                "--address",
                str(self.sock),
                "--namespace",
                "k8s.io",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and p.returncode != 0:
            raise RuntimeError(f"{self.name}: ctr {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout

    def import_image(self, archive: Path) -> None:
        t0 = time.monotonic()
        self.ctr("images", "import", "--no-unpack", str(archive))
        self.say(f"{self.name}: imported {archive.name} in {time.monotonic() - t0:.1f}s")

    def tasks(self) -> dict[str, int]:
        """The containers' tasks that run: {container id: pid}."""
        out: dict[str, int] = {}
        for line in self.ctr("tasks", "ls").splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "RUNNING":
                out[parts[0]] = int(parts[1])
        return out

    def images(self) -> list[str]:
        return self.ctr("images", "ls", "--quiet").split()

    # -- configuration ---------------------------------------------------------------------

    def _pki(self) -> None:
        pki = self.plane.pki
        pki.client(f"{self.name}-kubelet-client", f"system:node:{self.name}", "system:nodes")
        pki.server(f"{self.name}-kubelet", f"system:node:{self.name}", [self.spec.ip], [self.name])
        server = f"https://{API_IP}:{API_PORT}"
        self.plane.kubeconfig(f"{self.name}-kubelet", f"{self.name}-kubelet-client", server)
        self.plane.kubeconfig(f"{self.name}-kube-proxy", "kube-proxy", server)

    def _cni_config(self) -> None:
        """The bridge CNI: cni0 in the node, the node's range from host-local (its state in the
        node's directory), the gateway on the bridge, no masquerade (the node routes the pods'
        addresses as they are: cozyebpf's egress gives a backend's packets its LB IP)."""
        conf = {
            "cniVersion": "1.0.0",
            "name": "cozylab",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(self.state / "cni" / "ipam"),
                        "ranges": [[{"subnet": self.spec.pod_cidr, "gateway": self.spec.pod_gw}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                    },
                }
            ],
        }
        (self.state / "cni" / "net.d" / "10-cozylab.conflist").write_text(
            json.dumps(conf, indent=1)
        )

    def _containerd_config(self) -> None:
        cri = "io.containerd.cri.v1"
        text = f"""# {self.name}'s containerd (cozylab/realnode/node.py)
version = 3
root = "{self.state / "containerd"}"
state = "{self.run / "containerd"}"

[grpc]
  address = "{self.sock}"

[ttrpc]
  address = "{self.sock}.ttrpc"

[plugins."{cri}.images"]
  snapshotter = "overlayfs"
  [plugins."{cri}.images".pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins."{cri}.runtime"]
  netns_mounts_under_state_dir = true
  # The machine's root has no CAP_SYS_RESOURCE: no process may lower its oom_score_adj, and
  # runc fails to give the sandbox its -998 ("failed to update /proc/self/oom_score_adj:
  # Permission denied"). As rootless containerd does, the value is raised to containerd's own.
  restrict_oom_score_adj = true
  enable_cdi = false
  [plugins."{cri}.runtime".cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{self.state / "cni" / "net.d"}"
  [plugins."{cri}.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."{cri}.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."{cri}.runtime".containerd.runtimes.runc.options]
        BinaryName = "{self.bin / "runc"}"
        SystemdCgroup = false
        Root = "{self.run / "runc"}"

[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"

[plugins."io.containerd.nri.v1.nri"]
  disable = true
"""
        (self.state / "containerd.toml").write_text(text)

    def _kubelet_config(self) -> None:
        pki = self.plane.pki
        cfg: dict[str, Any] = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroups.path(self.name),
            "cgroupsPerQOS": True,
            "enforceNodeAllocatable": [],
            "failSwapOn": False,
            "podLogsDir": str(self.state / "pod-logs"),
            "address": self.spec.ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 10248,
            "tlsCertFile": str(pki.crt(f"{self.name}-kubelet")),
            "tlsPrivateKeyFile": str(pki.key(f"{self.name}-kubelet")),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(pki.ca)},
            },
            "authorization": {"mode": "Webhook"},
            "clusterDomain": "cluster.local",
            "resolvConf": str(self._resolv_conf()),
            # a small machine's disk and memory: evict only when nearly full, and keep the
            # images the lab imported (no registry to pull them from again)
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "maxPods": 30,
            "serializeImagePulls": False,
            "registerNode": True,
            "nodeStatusUpdateFrequency": "4s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "0s",
            "shutdownGracePeriod": "0s",
            # -999 by default: the machine's root may not lower it (no CAP_SYS_RESOURCE)
            "oomScoreAdj": 0,
        }
        (self.state / "kubelet.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def _resolv_conf(self) -> Path:
        p = self.state / "resolv.conf"
        p.write_text("# the lab has no DNS\n")
        return p

    def _kubelet_argv(self) -> list[str]:
        return [
            str(kube_bin("kubelet")),
            f"--config={self.state / 'kubelet.yaml'}",
            f"--kubeconfig={self.plane.workdir / f'{self.name}-kubelet.kubeconfig'}",
            f"--root-dir={self.kubelet_root}",
            f"--hostname-override={self.name}",
            f"--node-ip={self.spec.ip}",
            "--v=1",
        ]

    def _kube_proxy_config(self) -> None:
        cfg = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {
                "kubeconfig": str(self.plane.workdir / f"{self.name}-kube-proxy.kubeconfig")
            },
            "mode": "nftables",
            "hostnameOverride": self.name,
            "clusterCIDR": self.cluster_cidr,
            # conntrack's table size is the machine's (not per namespace): left as it is
            "conntrack": {"maxPerCore": 0},
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            "oomScoreAdj": 0,  # as the kubelet's
        }
        (self.state / "kube-proxy.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))

    def _kube_proxy_argv(self) -> list[str]:
        return [str(kube_bin("kube-proxy")), f"--config={self.state / 'kube-proxy.yaml'}", "--v=1"]
