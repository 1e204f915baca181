"""The control plane's processes (`ControlPlane`): etcd, kube-apiserver and
kube-controller-manager in a namespace of their own, started, restarted and stopped by their
pids; their kubeconfigs, the in-cluster credentials of an agent, the wiring to a lab's network,
etcd's compaction and what a lab wrote removed."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cozylab.kubecp import audit
from cozylab.kubecp.client import Kube, KubeError
from cozylab.kubecp.pki import Pki
from cozylab.kubecp.spec import (
    API_PORT,
    CONTROLLERS,
    ETCD_PEER_PORT,
    ETCD_PORT,
    ISSUER,
    SERVICE_CIDR,
    Obj,
    bin_dir,
    etcd_version,
    kube_version,
    missing_prerequisites,
)
from cozylab.netns import in_netns, run, wait_for


@dataclass
class Process:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None


class ControlPlane:
    """etcd, kube-apiserver and kube-controller-manager in the namespace `<prefix>-cp`, with
    `ip` as the API server's address on the networks `attach` wires it to. `start()` returns
    once the API server is ready and the controllers run; `stop()` stops them and removes the
    namespace and the run directory's processes (files stay in `workdir` for the logs)."""

    def __init__(
        self,
        prefix: str,
        workdir: Path,
        ip: str,
        log: Callable[[str], None] = lambda s: None,
        controllers: Sequence[str] = CONTROLLERS,
        scheduler: bool = False,
    ) -> None:
        self.ns = f"{prefix}-cp"
        #: kube-controller-manager's controllers; the real-node lab adds the workloads'
        self.controllers = tuple(controllers)
        #: kube-scheduler too (the real-node lab: kubelets run what it places)
        self.scheduler = scheduler
        self.workdir = workdir
        self.ip = ip
        self.say = log
        self.bin = bin_dir()
        self.pki = Pki(workdir / "pki")
        self.procs: dict[str, Process] = {}
        self.started = 0.0
        self.apiserver_starts = 0
        self.timings: dict[str, float] = {}
        self._attached: list[str] = []

    # -- up and down ---------------------------------------------------------------------

    def start(self) -> ControlPlane:
        missing = missing_prerequisites()
        if missing:
            raise RuntimeError(f"the labs' control plane needs {'; '.join(missing)}")
        t0 = time.monotonic()
        try:
            run("ip", "netns", "del", self.ns, check=False)
            run("ip", "netns", "add", self.ns)
            run("ip", "-n", self.ns, "link", "set", "lo", "up")
            self.pki.make([self.ip])
            self._kubeconfig("kcm", "kcm")
            self._kubeconfig("scheduler", "scheduler")
            self.workdir.joinpath("etcd").mkdir(parents=True, exist_ok=True)
            self._start("etcd", self._etcd_argv())
            wait_for(self._etcd_healthy, 30, lambda: f"etcd to answer: {self._tail('etcd')}")
            self.timings["etcd"] = time.monotonic() - t0
            self.start_apiserver()
            self.timings["kube-apiserver"] = time.monotonic() - t0
            self._start("kube-controller-manager", self._kcm_argv())
            # the ServiceAccount controller made the default namespace's "default": Pods can
            # be created (ServiceAccount admission); the tokens of the controllers exist
            wait_for(
                lambda: self.admin.get("ServiceAccount", "default", "default"),
                60,
                lambda: f"kube-controller-manager: {self._tail('kube-controller-manager')}",
            )
            self.timings["kube-controller-manager"] = time.monotonic() - t0
            if self.scheduler:
                self._start("kube-scheduler", self._scheduler_argv())
        except BaseException:
            self.stop()
            raise
        self.started = time.monotonic()
        self.say(
            f"control plane (Kubernetes {kube_version()}, etcd {etcd_version()}) up in "
            f"{time.monotonic() - t0:.1f}s"
        )
        return self

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            self._stop(name)
        self.procs.clear()
        run("ip", "netns", "del", self.ns, check=False)

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self, name: str, argv: list[str]) -> Process:
        p = Process(name, argv, self.workdir / f"{name}.log")
        with p.log.open("ab") as out:
            out.write(f"=== {' '.join(argv)}\n".encode())
            out.flush()
            p.proc = subprocess.Popen(
                [
                    "nsenter",
                    f"--net=/run/netns/{self.ns}",
                    # killed with the thread that started it: a lab killed by SIGKILL leaves
                    # no daemon running (util-linux setpriv; nsenter --net does not fork)
                    *(["setpriv", "--pdeathsig", "KILL", "--"] if shutil.which("setpriv") else []),
                    *argv,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.workdir,
            )
        self.procs[name] = p
        return p

    def _stop(self, name: str, sig: int = signal.SIGTERM) -> int | None:
        p = self.procs.get(name)
        if p is None or p.proc is None:
            return None
        if p.proc.poll() is None:
            p.proc.send_signal(sig)
            try:
                p.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait()
        rc = p.proc.returncode
        p.proc = None
        return rc

    def running(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.proc is not None and p.proc.poll() is None

    def _tail(self, name: str, chars: int = 2000) -> str:
        log = self.workdir / f"{name}.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else "(no log)"

    # -- the components ------------------------------------------------------------------

    def _etcd_argv(self) -> list[str]:
        client, peer = f"http://127.0.0.1:{ETCD_PORT}", f"http://127.0.0.1:{ETCD_PEER_PORT}"
        return [
            str(self.bin / "etcd"),
            "--name=cozylab",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=cozylab={peer}",
            "--unsafe-no-fsync",  # a lab's data: speed over durability
            "--log-level=warn",
        ]

    def _apiserver_argv(self) -> list[str]:
        pki = self.pki
        return [
            str(self.bin / "kube-apiserver"),
            f"--etcd-servers=http://127.0.0.1:{ETCD_PORT}",
            f"--advertise-address={self.ip}",
            "--bind-address=0.0.0.0",
            f"--secure-port={API_PORT}",
            f"--tls-cert-file={pki.crt('apiserver')}",
            f"--tls-private-key-file={pki.key('apiserver')}",
            f"--client-ca-file={pki.ca}",
            "--authorization-mode=Node,RBAC",
            f"--service-account-issuer={ISSUER}",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--enable-admission-plugins=NodeRestriction",
            # the kubelets (the real-node lab): exec, logs and port-forward go to their
            # InternalIP with a client certificate of the CA, and their serving certificates
            # are the CA's too
            f"--kubelet-client-certificate={pki.crt('apiserver-kubelet-client')}",
            f"--kubelet-client-key={pki.key('apiserver-kubelet-client')}",
            f"--kubelet-certificate-authority={pki.ca}",
            "--kubelet-preferred-address-types=InternalIP",
            "--profiling=false",
            f"--audit-policy-file={audit.policy_file(self.workdir)}",
            f"--audit-log-path={self.audit_log}",
            "--v=1",
        ]

    @property
    def audit_log(self) -> Path:
        """kube-apiserver's audit log (cozylab/kubecp/audit.py: the policy, and `requests`
        reads it)."""
        return self.workdir / "audit.log"

    def _kcm_argv(self) -> list[str]:
        return [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.workdir / 'kcm.kubeconfig'}",
            f"--controllers={','.join(self.controllers)}",
            f"--service-account-private-key-file={self.pki.sa_key}",
            f"--root-ca-file={self.pki.ca}",
            "--use-service-account-credentials=true",
            "--leader-elect=false",
            "--secure-port=0",
            "--cluster-name=cozylab",
            "--v=1",
        ]

    def _scheduler_argv(self) -> list[str]:
        return [
            str(self.bin / "kube-scheduler"),
            f"--kubeconfig={self.workdir / 'scheduler.kubeconfig'}",
            "--leader-elect=false",
            "--secure-port=0",
            "--v=1",
        ]

    def start_apiserver(self, timeout: float = 90) -> float:
        """Start kube-apiserver and wait for /readyz; the seconds that took."""
        t0 = time.monotonic()
        self.apiserver_starts += 1
        self._start("kube-apiserver", self._apiserver_argv())
        wait_for(
            self._ready,
            timeout,
            lambda: f"kube-apiserver to be ready: {self._tail('kube-apiserver')}",
        )
        return time.monotonic() - t0

    def restart_controllers(self) -> None:
        """A new kube-controller-manager: after kube-apiserver restarted a few times, the old
        one's informers back off up to 30 s (client-go's reflector) before its controllers
        see anything again; a new one lists at once (for a test module that goes on)."""
        self._stop("kube-controller-manager")
        self._start("kube-controller-manager", self._kcm_argv())

    def kill_apiserver(self, sig: int = signal.SIGKILL) -> int | None:
        """Stop kube-apiserver (SIGKILL: as a crash, every connection reset)."""
        return self._stop("kube-apiserver", sig)

    def _ready(self) -> bool:
        if not self.running("kube-apiserver"):
            raise RuntimeError(f"kube-apiserver exited: {self._tail('kube-apiserver')}")
        try:
            self.admin.request("GET", "/readyz", timeout=5)
        except (OSError, KubeError, http.client.HTTPException):
            return False
        return True

    def _kubeconfig(self, user: str, cert: str) -> Path:
        return self.kubeconfig(user, cert, f"https://127.0.0.1:{API_PORT}")

    def kubeconfig(self, user: str, cert: str, server: str) -> Path:
        """A kubeconfig `workdir`/`user`.kubeconfig for the client certificate `cert` of the
        lab's CA, to the API server at `server`."""
        path = self.workdir / f"{user}.kubeconfig"
        pki = self.pki
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "cozylab",
                    "cluster": {
                        "server": server,
                        "certificate-authority": str(pki.ca),
                    },
                }
            ],
            "users": [
                {
                    "name": user,
                    "user": {
                        "client-certificate": str(pki.crt(cert)),
                        "client-key": str(pki.key(cert)),
                    },
                }
            ],
            "contexts": [{"name": user, "context": {"cluster": "cozylab", "user": user}}],
            "current-context": user,
        }
        path.write_text(json.dumps(cfg, indent=1))
        return path

    # -- clients -------------------------------------------------------------------------

    @property
    def admin(self) -> Kube:
        """The lab's admin (system:masters), from inside the control plane's namespace."""
        return Kube(
            self.ns,
            "127.0.0.1",
            API_PORT,
            self.pki.ca,
            (self.pki.crt("admin"), self.pki.key("admin")),
        )

    def in_cluster(self, where: Path, namespace: str, token: str) -> Path:
        """The files a pod's ServiceAccount volume holds (token, ca.crt, namespace), in
        `where`: what the official client's in-cluster configuration reads."""
        where.mkdir(parents=True, exist_ok=True)
        (where / "token").write_text(token)
        shutil.copyfile(self.pki.ca, where / "ca.crt")
        (where / "namespace").write_text(namespace)
        return where

    def env(self) -> dict[str, str]:
        """The environment of a pod that reaches the API server (what the kubelet sets; here
        the API server's own address: the lab has no kube-proxy for the ClusterIP)."""
        return {"KUBERNETES_SERVICE_HOST": self.ip, "KUBERNETES_SERVICE_PORT": str(API_PORT)}

    # -- the lab's network ---------------------------------------------------------------

    def attach(self, peer_ns: str, bridge: str, prefix_len: int, dev: str = "eth0") -> None:
        """Wire the control plane to the bridge `bridge` of namespace `peer_ns` (a veth; its
        address `ip`/`prefix_len`), replacing an earlier attachment."""
        peer = "swcp"
        run("ip", "-n", self.ns, "link", "del", dev, check=False)
        run(
            "ip",
            "-n",
            self.ns,
            "link",
            "add",
            dev,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            peer_ns,
        )
        run("ip", "-n", peer_ns, "link", "set", peer, "master", bridge, "up")
        run("ip", "-n", self.ns, "addr", "add", f"{self.ip}/{prefix_len}", "dev", dev)
        run("ip", "-n", self.ns, "link", "set", dev, "up")

    def link(
        self, peer_ns: str, peer_dev: str, peer_ip: str, prefix_len: int, dev: str = "eth0"
    ) -> None:
        """Wire the control plane to namespace `peer_ns` by a veth of its own: `peer_dev`
        there with `peer_ip`, `dev` here with `ip` (both /`prefix_len`), replacing an earlier
        attachment."""
        run("ip", "-n", self.ns, "link", "del", dev, check=False)
        run(
            "ip",
            *("-n", self.ns, "link", "add", dev, "type", "veth"),
            *("peer", "name", peer_dev, "netns", peer_ns),
        )
        run("ip", "-n", peer_ns, "addr", "add", f"{peer_ip}/{prefix_len}", "dev", peer_dev)
        run("ip", "-n", peer_ns, "link", "set", peer_dev, "up")
        run("ip", "-n", self.ns, "addr", "add", f"{self.ip}/{prefix_len}", "dev", dev)
        run("ip", "-n", self.ns, "link", "set", dev, "up")

    # -- etcd ----------------------------------------------------------------------------

    def _etcd(self, path: str, body: Obj) -> Obj:
        def call() -> Obj:
            conn = http.client.HTTPConnection("127.0.0.1", ETCD_PORT, timeout=10)
            try:
                conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
            finally:
                conn.close()
            if resp.status != 200:
                raise RuntimeError(f"etcd {path}: HTTP {resp.status}: {data[:300]!r}")
            out: Obj = json.loads(data)
            return out

        return in_netns(self.ns, call)

    def _etcd_healthy(self) -> bool:
        if not self.running("etcd"):
            raise RuntimeError(f"etcd exited: {self._tail('etcd')}")
        try:
            return bool(self.etcd_revision())
        except (OSError, RuntimeError):
            return False

    def etcd_revision(self) -> int:
        """etcd's current revision (the resourceVersion of the last write)."""
        key = base64.b64encode(b"/registry/").decode()
        got = self._etcd("/v3/kv/range", {"key": key, "count_only": True})
        return int(got["header"]["revision"])

    def compact(self, revision: int | None = None) -> int:
        """Compact etcd's history up to `revision` (default: the current one), physically:
        a watch or list from an older resourceVersion can no longer be served from etcd."""
        rev = revision or self.etcd_revision()
        self._etcd("/v3/kv/compaction", {"revision": str(rev), "physical": True})
        return rev

    # -- what a lab wrote ----------------------------------------------------------------

    def clean(self, namespaces: Iterable[str], cluster_kinds: Sequence[str] = ("Node",)) -> None:
        """Remove what a lab wrote: its namespaces' Services, Pods, EndpointSlices and Events
        (the namespaces themselves stay: deleting one takes the namespace controller's time),
        and every object of `cluster_kinds`; wait until the slices are gone."""
        admin = self.admin
        present = [ns for ns in namespaces if admin.get("Namespace", None, ns) is not None]
        for ns in present:
            for kind in ("Service", "Pod", "EndpointSlice", "Event"):
                admin.delete_all(kind, ns)
        for kind in cluster_kinds:
            admin.delete_all(kind)

        def left(ns: str) -> list[str]:
            """What is still in `ns`, deleted again: the EndpointSlice controller writes a
            Service's slice anew when it syncs the Service from its cache after the slice was
            deleted and before it saw the Service go (the garbage collector removes that one
            in time, but a loaded machine made it miss 30 s once)."""
            names = []
            for kind in ("Service", "Pod", "EndpointSlice"):
                objs = admin.list(kind, ns)
                if objs:
                    names += [f"{kind}/{o['metadata']['name']}" for o in objs]
                    admin.delete_all(kind, ns)
            return names

        deadline = time.monotonic() + 60
        for ns in present:
            with contextlib.suppress(KubeError):
                while names := left(ns):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the namespace {ns} is not empty after 60 s: {names}")
                    time.sleep(0.2)
