"""The control plane's certificates: the lab's CA, the API server's serving certificate, the
clients' certificates, the ServiceAccount signing key (`Pki`, made with `cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cozylab.kubecp.spec import FIRST_SERVICE_IP


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
        self.root.joinpath("ca.key").write_bytes(pem_key(ca_key))

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
        self._issue("apiserver", "kube-apiserver", None, ExtendedKeyUsageOID.SERVER_AUTH, alt)
        self.client("admin", "cozylab-admin", "system:masters")
        self.client("kcm", "system:kube-controller-manager")
        # what the real-node lab's components are (cozylab/realnode/): the API server as the
        # kubelets' client (exec, logs, port-forward), the scheduler, kube-proxy
        self.client("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters")
        self.client("scheduler", "system:kube-scheduler")
        self.client("kube-proxy", "system:kube-proxy")
        sa = ec.generate_private_key(ec.SECP256R1())
        self.sa_key.write_bytes(pem_key(sa))
        self.sa_pub.write_bytes(
            sa.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        return self

    def client(self, file: str, cn: str, org: str | None = None) -> Pki:
        """A client certificate of the CA for the user `cn` in the group `org` (files `file`.crt
        and `file`.key)."""
        from cryptography.x509.oid import ExtendedKeyUsageOID

        self._issue(file, cn, org, ExtendedKeyUsageOID.CLIENT_AUTH, [])
        return self

    def server(self, file: str, cn: str, ips: Sequence[str], names: Sequence[str] = ()) -> Pki:
        """A serving certificate of the CA for the addresses `ips` and DNS `names`."""
        from cryptography import x509
        from cryptography.x509.oid import ExtendedKeyUsageOID

        alt: list[x509.GeneralName] = [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        alt += [x509.DNSName(n) for n in names]
        self._issue(file, cn, None, ExtendedKeyUsageOID.SERVER_AUTH, alt)
        return self

    def _issue(
        self, file: str, cn: str, org: str | None, usage: object, alt: Sequence[object]
    ) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        ca = x509.load_pem_x509_certificate(self.ca.read_bytes())
        ca_key = serialization.load_pem_private_key(self.root.joinpath("ca.key").read_bytes(), None)
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
        if org:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(ca.not_valid_before)
            .not_valid_after(ca.not_valid_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)  # type: ignore[list-item]
        )
        if alt:
            b = b.add_extension(x509.SubjectAlternativeName(alt), critical=False)  # type: ignore[arg-type]
        cert = b.sign(ca_key, hashes.SHA256())
        self.crt(file).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        self.key(file).write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
