"""The labs' Kubernetes control plane: the real etcd, kube-apiserver and kube-controller-manager
(issue 35), built from the Go module proxy by scripts/build-kube.sh (the release that
cozylab/controlplane/kube/go.mod pins), run in a network namespace of their own.

- **etcd** on the namespace's 127.0.0.1 (fsync off: a lab's data lives as long as the lab).
- **kube-apiserver** on 0.0.0.0:6443 of the namespace: TLS with a certificate of the lab's CA
  (`Pki`, made with `cryptography`) for its address on the lab's network, the first Service IP
  and kubernetes.default.svc; client certificates of that CA (the lab's admin is in
  system:masters; kube-controller-manager is system:kube-controller-manager); authorization
  Node,RBAC; ServiceAccount tokens signed with a key of the lab's; the lab's Service range
  `SERVICE_CIDR`.
- **kube-controller-manager**: the controllers the labs need (`CONTROLLERS`: the EndpointSlice
  controller writes every Service's slices from the Pods the lab creates; serviceaccount,
  serviceaccount-token, namespace, garbagecollector), each with its own ServiceAccount's
  credentials (--use-service-account-credentials), as Talos and kubeadm run it.

No kubelet, no scheduler, no kube-proxy: the lab creates Pods with spec.nodeName and writes
their status (podIP, phase, Ready) as a kubelet would; `attach` wires the namespace to a lab's
network, so that agents reach the API server over it. `Kube` is a small client of the API for
the lab (admin, or any bearer token), over sockets made in the control plane's namespace (or a
lab namespace). A `ControlPlane` is shared by the labs of a test module: `clean` removes what a
lab wrote.

What it leaves out: a kubelet and the node lifecycle controller (Nodes are created and their
addresses written by the lab; no Node goes NotReady), the scheduler, kube-proxy and ClusterIP
traffic, cloud controllers, aggregated APIs (no front proxy), HA (one etcd, one API server).
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import http.client
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cozylab.netns import in_netns, run, wait_for

REPO = Path(__file__).resolve().parents[1]
KUBE_GO_MOD = REPO / "cozylab" / "controlplane" / "kube" / "go.mod"
ETCD_GO_MOD = REPO / "cozylab" / "controlplane" / "etcd" / "go.mod"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager")

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


def bin_dir() -> Path:
    """Where scripts/build-kube.sh puts the binaries (COZYEBPF_KUBE_CACHE, as it reads it)."""
    cache = os.environ.get("COZYEBPF_KUBE_CACHE") or "/var/cache/cozyebpf/kube"
    return Path(cache) / kube_version()


def missing_prerequisites() -> list[str]:
    """The binaries that are not built yet, with how to build them."""
    d = bin_dir()
    lacking = [b for b in BINARIES if not os.access(d / b, os.X_OK)]
    if not lacking:
        return []
    return [
        f"{', '.join(lacking)} of Kubernetes {kube_version()} in {d} (scripts/setup.sh builds "
        "them from the Go module proxy: scripts/build-kube.sh)"
    ]


# -- certificates ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    """The lab's CA and what it signed, as files in `root`."""

    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.crt"

    def crt(self, name: str) -> Path:
        return self.root / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.root / f"{name}.key"

    @property
    def sa_key(self) -> Path:
        return self.root / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.root / "sa.pub"

    def make(self, api_ips: Sequence[str]) -> Pki:
        """A CA; the API server's serving certificate for `api_ips`, the first Service IP and
        the names kubernetes.default.svc has; client certificates for the lab's admin
        (system:masters) and kube-controller-manager; the ServiceAccount signing key."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        self.root.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
        later = now + datetime.timedelta(days=2)

        def pem_key(k: ec.EllipticCurvePrivateKey) -> bytes:
            return k.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )

        def name(cn: str, org: str | None = None) -> x509.Name:
            attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
            if org:
                attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
            return x509.Name(attrs)

        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = name("cozylab-ca")
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(later)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(ca_key, hashes.SHA256())
        )
        self.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

        def issue(
            file: str, subject: x509.Name, usage: x509.ObjectIdentifier, alt: list[x509.GeneralName]
        ) -> None:
            key = ec.generate_private_key(ec.SECP256R1())
            b = (
                x509.CertificateBuilder()
                .subject_name(subject)
                .issuer_name(ca_name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now)
                .not_valid_after(later)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            )
            if alt:
                b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)
            cert = b.sign(ca_key, hashes.SHA256())
            self.crt(file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
            self.key(file).write_bytes(pem_key(key))

        alt: list[x509.GeneralName] = [
            x509.IPAddress(ipaddress.ip_address(ip))
            for ip in dict.fromkeys([*api_ips, "127.0.0.1", FIRST_SERVICE_IP])
        ]
        alt += [
            x509.DNSName(n)
            for n in (
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            )
        ]
        issue("apiserver", name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, alt)
        client = ExtendedKeyUsageOID.CLIENT_AUTH
        issue("admin", name("cozylab-admin", "system:masters"), client, [])
        issue("kcm", name("system:kube-controller-manager"), client, [])
        sa = ec.generate_private_key(ec.SECP256R1())
        self.sa_key.write_bytes(pem_key(sa))
        self.sa_pub.write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return self


# -- a client of the API, for the lab ----------------------------------------------------------


class KubeError(RuntimeError):
    """A non-2xx answer of the API server: `status` and its Status object."""

    def __init__(self, method: str, path: str, status: int, body: Obj) -> None:
        self.status = status
        self.body = body
        self.reason = str(body.get("reason") or "")
        self.message = str(body.get("message") or body)
        super().__init__(f"{method} {path}: HTTP {status} {self.reason}: {self.message}")


class _NsHTTPS(http.client.HTTPSConnection):
    """HTTPS over a socket made in the network namespace `netns`."""

    def __init__(
        self, netns: str, host: str, port: int, context: ssl.SSLContext, timeout: float
    ) -> None:
        super().__init__(host, port, context=context, timeout=timeout)
        self.netns = netns
        self._ctx = context

    def connect(self) -> None:
        sock = in_netns(self.netns, lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        sock.settimeout(self.timeout)
        try:
            sock.connect((self.host, self.port))
            self.sock = self._ctx.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


#: the plural and API path prefix of the kinds the labs write
_KINDS: dict[str, tuple[str, str, bool]] = {
    # kind: (prefix, plural, namespaced)
    "Namespace": ("/api/v1", "namespaces", False),
    "Node": ("/api/v1", "nodes", False),
    "Service": ("/api/v1", "services", True),
    "Pod": ("/api/v1", "pods", True),
    "Event": ("/api/v1", "events", True),
    "ServiceAccount": ("/api/v1", "serviceaccounts", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
    "EndpointSlice": ("/apis/discovery.k8s.io/v1", "endpointslices", True),
    "ClusterRole": ("/apis/rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ValidatingAdmissionPolicy": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicies",
        False,
    ),
    "ValidatingAdmissionPolicyBinding": (
        "/apis/admissionregistration.k8s.io/v1",
        "validatingadmissionpolicybindings",
        False,
    ),
}


def path_of(kind: str, namespace: str | None = None, name: str | None = None) -> str:
    """The REST path of `kind` (all namespaces when `namespace` is None), or of one object."""
    prefix, plural, namespaced = _KINDS[kind]
    p = prefix
    if namespaced and namespace is not None:
        p += f"/namespaces/{namespace}"
    p += f"/{plural}"
    return f"{p}/{name}" if name else p


class Kube:
    """Requests to the API server at host:port, over sockets made in `netns`, as the lab's
    admin (a client certificate) or as whoever `token` is. One connection per request: it
    outlives an API server restart and is safe from any thread."""

    def __init__(
        self,
        netns: str,
        host: str,
        port: int,
        ca: Path,
        cert: tuple[Path, Path] | None = None,
        token: str | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.netns, self.host, self.port, self.timeout = netns, host, port, timeout
        self.bearer = token
        self.ca = ca
        self.ctx = ssl.create_default_context(cafile=str(ca))
        if cert is not None:
            self.ctx.load_cert_chain(str(cert[0]), str(cert[1]))

    def as_token(self, token: str) -> Kube:
        """The same server, as the bearer of `token` (no client certificate)."""
        return Kube(self.netns, self.host, self.port, self.ca, token=token, timeout=self.timeout)

    def _send(
        self,
        method: str,
        path: str,
        body: Any,
        query: Mapping[str, str] | None,
        content_type: str,
        timeout: float | None,
        accept: str,
    ) -> tuple[int, bytes]:
        if query:
            path += "?" + urllib.parse.urlencode(query)
        headers = {"Accept": accept}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        if self.bearer:
            headers["Authorization"] = f"Bearer {self.bearer}"
        conn = _NsHTTPS(self.netns, self.host, self.port, self.ctx, timeout or self.timeout)
        try:
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float | None = None,
    ) -> Obj:
        """The decoded answer of a 2xx; KubeError otherwise."""
        status, raw = self._send(
            method, path, body, query, content_type, timeout, "application/json"
        )
        try:
            out = json.loads(raw) if raw else {}
        except ValueError:
            out = {"message": raw.decode(errors="replace")}
        if not 200 <= status <= 299:
            raise KubeError(method, path, status, out if isinstance(out, dict) else {})
        return out if isinstance(out, dict) else {"value": out}

    def request_text(self, method: str, path: str) -> str:
        """The text of a 2xx answer (/metrics, /healthz); KubeError otherwise."""
        status, raw = self._send(method, path, None, None, "", None, "text/plain")
        text = raw.decode(errors="replace")
        if not 200 <= status <= 299:
            raise KubeError(method, path, status, {"message": text[:500]})
        return text

    # -- objects -------------------------------------------------------------------------

    def get(self, kind: str, namespace: str | None, name: str) -> Obj | None:
        try:
            return self.request("GET", path_of(kind, namespace, name))
        except KubeError as e:
            if e.status == 404:
                return None
            raise

    def list(
        self, kind: str, namespace: str | None = None, selector: str | None = None
    ) -> list[Obj]:
        query = {"labelSelector": selector} if selector else None
        items = self.request("GET", path_of(kind, namespace), query=query).get("items") or []
        return [i for i in items if isinstance(i, dict)]

    def create(self, obj: Obj) -> Obj:
        ns = obj.get("metadata", {}).get("namespace")
        return self.request("POST", path_of(obj["kind"], ns), obj)

    def apply(self, obj: Obj, subresource: str = "", manager: str = "cozylab") -> Obj:
        """Server-side apply (create or update; fields the manager applied before and leaves
        out are removed), forced: the lab owns what it applies."""
        meta = obj.get("metadata", {})
        path = path_of(obj["kind"], meta.get("namespace"), meta["name"])
        return self.request(
            "PATCH",
            path + (f"/{subresource}" if subresource else ""),
            obj,
            query={"fieldManager": manager, "force": "true"},
            content_type="application/apply-patch+yaml",
        )

    def delete(self, kind: str, namespace: str | None, name: str, missing_ok: bool = True) -> None:
        """Delete now (grace period 0: no kubelet confirms a Pod's end here)."""
        try:
            self.request(
                "DELETE",
                path_of(kind, namespace, name),
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
            )
        except KubeError as e:
            if not (missing_ok and e.status == 404):
                raise

    def delete_all(self, kind: str, namespace: str | None = None, selector: str = "") -> None:
        """Delete every object of `kind` (in `namespace`; with the label selector)."""
        query = {"gracePeriodSeconds": "0"}
        if selector:
            query["labelSelector"] = selector
        self.request("DELETE", path_of(kind, namespace), query=query)

    def token(
        self,
        namespace: str,
        service_account: str,
        seconds: int = 3600,
        pod: Obj | None = None,
    ) -> str:
        """A token of the ServiceAccount from the TokenRequest API (bound to `pod`, as the
        kubelet asks for the tokens it mounts)."""
        spec: Obj = {"expirationSeconds": seconds}
        if pod is not None:
            spec["boundObjectRef"] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod["metadata"]["name"],
                "uid": pod["metadata"]["uid"],
            }
        got = self.request(
            "POST",
            path_of("ServiceAccount", namespace, service_account) + "/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        return str(got["status"]["token"])


# -- the control plane -------------------------------------------------------------------------


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
    ) -> None:
        self.ns = f"{prefix}-cp"
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
            "--profiling=false",
            "--v=1",
        ]

    def _kcm_argv(self) -> list[str]:
        return [
            str(self.bin / "kube-controller-manager"),
            f"--kubeconfig={self.workdir / 'kcm.kubeconfig'}",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--service-account-private-key-file={self.pki.sa_key}",
            f"--root-ca-file={self.pki.ca}",
            "--use-service-account-credentials=true",
            "--leader-elect=false",
            "--secure-port=0",
            "--cluster-name=cozylab",
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
        path = self.workdir / f"{user}.kubeconfig"
        pki = self.pki
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "cozylab",
                    "cluster": {
                        "server": f"https://127.0.0.1:{API_PORT}",
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
        for ns in namespaces:
            if admin.get("Namespace", None, ns) is None:
                continue
            for kind in ("Service", "Pod", "EndpointSlice", "Event"):
                admin.delete_all(kind, ns)
        for kind in cluster_kinds:
            admin.delete_all(kind)
        for ns in namespaces:
            with contextlib.suppress(KubeError):
                wait_for(
                    lambda ns=ns: (
                        not admin.list("EndpointSlice", ns)  # type: ignore[misc]
                        and not admin.list("Pod", ns)
                    ),
                    30,
                    f"the namespace {ns} to be empty",
                )
