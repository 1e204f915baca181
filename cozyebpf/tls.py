"""The metrics server's TLS (issue 28, item 1): the certificate of `--metrics-cert-dir`
(tls.crt and tls.key, e.g. a mounted Secret), or else one made at start, self-signed and kept
in memory (the root file system is read-only). Who may read the metrics is
`cozyebpf/kube/metricsauth.py`'s."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import ssl
import subprocess
import sys
from collections.abc import Iterator

from cozyebpf.errors import PermanentError

log = logging.getLogger(__name__)


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
        [sys.executable, "-m", "cozyebpf.tls", *names],
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
