"""Metrics only for who may read them (issue 28, item 1).

The metrics name every managed Service with its traffic and drops, and the DaemonSet serves
them on the node's address, which every tenant's VM can reach. So by default they are served
as Kubernetes components and controller-runtime's secure metrics serve theirs:

- over HTTPS, with a certificate from `--metrics-cert-dir` (tls.crt and tls.key, e.g. a
  mounted Secret) or else one generated at start (self-signed, in memory: the root file system
  is read-only);
- to a caller whose bearer token a TokenReview authenticates and whose user a
  SubjectAccessReview allows `get` on the non-resource URL `/metrics` (a ClusterRole with
  `nonResourceURLs: ["/metrics"]`); 401 without a valid token, 403 without the right. Answers
  are cached for `CACHE_TTL` seconds per token (a hash of it), so a scrape every 30 s costs the
  API server two requests a minute per node at most.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import ipaddress
import logging
import os
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from cozyebpf.errors import PermanentError

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"
CACHE_TTL = 60.0  # seconds an answer (allowed or not) is kept per token
CACHE_MAX = 1024  # tokens remembered at most (then the cache starts over)


class KubeAuthorizer:
    """Is a request's `Authorization` header allowed to `get` `path`? Asks the API server
    (TokenReview, then SubjectAccessReview) through the agent's API client; answers cached."""

    def __init__(
        self,
        api_client: Any,
        path: str = "/metrics",
        ttl: float = CACHE_TTL,
        clock: Callable[[], float] = time.monotonic,
        timeout: float = 10.0,
    ) -> None:
        from cozyebpf.sources.kube import KubeRest

        self.rest = KubeRest(api_client)
        self.path = path
        self.ttl = ttl
        self.clock = clock
        self.timeout = timeout
        self._cache: dict[bytes, tuple[float, int, str]] = {}
        self._lock = threading.Lock()

    def __call__(self, authorization: str | None) -> tuple[int, str]:
        """(200, "") when allowed; (401 or 403, why) when not. An API error raises (and is
        not cached): the caller answers 503."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return 401, "a bearer token is needed (Authorization: Bearer <token>)"
        key = hashlib.sha256(token.encode()).digest()
        now = self.clock()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and hit[0] > now:
            return hit[1], hit[2]
        code, why = self._review(token)
        with self._lock:
            if len(self._cache) >= CACHE_MAX:
                self._cache.clear()
            self._cache[key] = (now + self.ttl, code, why)
        return code, why

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = self.rest.json(
            "POST", path, body=body, content_type="application/json", timeout=self.timeout
        )
        return answer if isinstance(answer, dict) else {}

    def _review(self, token: str) -> tuple[int, str]:
        review = self._post(
            TOKEN_REVIEWS,
            {
                "apiVersion": "authentication.k8s.io/v1",
                "kind": "TokenReview",
                "spec": {"token": token},
            },
        )
        status = review.get("status") or {}
        user = status.get("user") or {}
        if not status.get("authenticated") or not user.get("username"):
            return 401, "the token is not valid"
        spec: dict[str, Any] = {
            "user": user["username"],
            "nonResourceAttributes": {"path": self.path, "verb": "get"},
        }
        for field in ("uid", "groups", "extra"):
            if user.get(field):
                spec[field] = user[field]
        access = self._post(
            ACCESS_REVIEWS,
            {
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SubjectAccessReview",
                "spec": spec,
            },
        )
        if (access.get("status") or {}).get("allowed"):
            return 200, ""
        return 403, f"{user['username']} may not get {self.path} (no ClusterRole grants it)"


# -- TLS ------------------------------------------------------------------------------------


def server_context(cert_dir: str, names: list[str]) -> ssl.SSLContext:
    """The server's TLS context: tls.crt and tls.key of `cert_dir` when both are there, else
    a self-signed certificate for `names` (DNS names or IP addresses) made now."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    crt, key = os.path.join(cert_dir, "tls.crt"), os.path.join(cert_dir, "tls.key")
    if cert_dir and os.path.exists(crt) and os.path.exists(key):
        try:
            ctx.load_cert_chain(crt, key)
        except (OSError, ssl.SSLError) as e:
            raise PermanentError(f"cannot load the metrics certificate {crt}: {e}") from e
        log.info("metrics: serving the certificate in %s", cert_dir)
        return ctx
    if cert_dir:
        log.warning("metrics: no tls.crt and tls.key in %s; generating a certificate", cert_dir)
    pem_crt, pem_key = self_signed_in_child(names)
    with _memfile(pem_crt) as crt_path, _memfile(pem_key) as key_path:
        ctx.load_cert_chain(crt_path, key_path)
    return ctx


def self_signed(names: list[str], days: int = 365) -> tuple[bytes, bytes]:
    """(certificate, key) in PEM: a P-256 key and a certificate for `names`, valid `days`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    alt: list[x509.GeneralName] = []
    for n in names:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            alt.append(x509.DNSName(n))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cozyebpf metrics")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key


def self_signed_in_child(names: list[str]) -> tuple[bytes, bytes]:
    """`self_signed` in a child process: importing cryptography would keep 7 MB resident in
    the agent for the one certificate it makes."""
    p = subprocess.run(
        [sys.executable, "-m", "cozyebpf.metricsauth", *names],
        capture_output=True,
        timeout=60,
        env=os.environ.copy(),
    )
    if p.returncode != 0:
        raise PermanentError(
            "cannot make the metrics certificate: "
            f"{p.stderr.decode(errors='replace').strip()[-500:]} (mount tls.crt and tls.key "
            "in --metrics-cert-dir, or install the cryptography package)"
        )
    crt, _, key = p.stdout.partition(b"\n\n")
    return crt + b"\n", key


@contextlib.contextmanager
def _memfile(data: bytes) -> Iterator[str]:
    """A path to `data` that touches no file system (a memfd): the root is read-only."""
    fd = os.memfd_create("cozyebpf-tls", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


if __name__ == "__main__":  # the child of self_signed_in_child: certificate, blank line, key
    _crt, _key = self_signed(sys.argv[1:])
    sys.stdout.buffer.write(_crt.rstrip(b"\n") + b"\n\n" + _key)
