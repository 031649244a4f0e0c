"""Certificates and keys for a throwaway local cluster: one CA, the apiserver's serving certificate,
client certificates per identity, the service-account signing key, and kubeconfig files.

ECDSA P-256 throughout: Kubernetes accepts it everywhere and it is generated in microseconds.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=30)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str, organizations: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attrs)


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


class ClusterPKI:
    """Writes the cluster's key material under `folder` (mode 0600 for private keys)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # tolerate small clock skew
        self._ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = _name("batchknee-devcluster-ca")
        self._ca_name = ca_name
        ca_cert = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(self._ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._now)
            .not_valid_after(self._now + _VALIDITY)
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
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self._ca_key.public_key()), False)
            .sign(self._ca_key, hashes.SHA256())
        )
        self._ca_cert = ca_cert
        self.ca = KeyPair(folder / "ca.crt", folder / "ca.key")
        self._write(self.ca.cert, ca_cert.public_bytes(serialization.Encoding.PEM))
        self._write(self.ca.key, _pem_key(self._ca_key), private=True)

        sa_key = ec.generate_private_key(ec.SECP256R1())
        self.service_account = KeyPair(folder / "sa.pub", folder / "sa.key")
        self._write(
            self.service_account.cert,
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            ),
        )
        self._write(self.service_account.key, _pem_key(sa_key), private=True)

    @staticmethod
    def _write(path: Path, data: bytes, private: bool = False) -> None:
        path.write_bytes(data)
        if private:
            path.chmod(0o600)

    def _issue(
        self,
        stem: str,
        common_name: str,
        organizations: tuple[str, ...],
        usage: list[x509.ObjectIdentifier],
        dns: tuple[str, ...] = (),
        ips: tuple[str, ...] = (),
    ) -> KeyPair:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, organizations))
            .issuer_name(self._ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(self._now)
            .not_valid_after(self._now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._ca_key.public_key()), False
            )
        )
        if dns or ips:
            names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._ca_key, hashes.SHA256())
        pair = KeyPair(self.folder / f"{stem}.crt", self.folder / f"{stem}.key")
        self._write(pair.cert, cert.public_bytes(serialization.Encoding.PEM))
        self._write(pair.key, _pem_key(key), private=True)
        return pair

    def serving(self, stem: str, dns: tuple[str, ...], ips: tuple[str, ...]) -> KeyPair:
        return self._issue(stem, dns[0], (), [ExtendedKeyUsageOID.SERVER_AUTH], dns=dns, ips=ips)

    def client(self, stem: str, user: str, groups: tuple[str, ...] = ()) -> KeyPair:
        return self._issue(stem, user, groups, [ExtendedKeyUsageOID.CLIENT_AUTH])


def write_kubeconfig(path: Path, server: str, ca: Path, client: KeyPair | str, user: str) -> Path:
    """A self-contained kubeconfig (certificates embedded) for one identity: a client certificate,
    or a bearer token (a ServiceAccount's)."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    credentials = (
        {"token": client}
        if isinstance(client, str)
        else {"client-certificate-data": b64(client.cert), "client-key-data": b64(client.key)}
    )
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "batchknee-dev", "cluster": {"server": server, "certificate-authority-data": b64(ca)}}
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "batchknee-dev", "context": {"cluster": "batchknee-dev", "user": user}}],
        "current-context": "batchknee-dev",
        "preferences": {},
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
