"""Throwaway certificates for trying mutual TLS on one machine (tests, bench/tls_overhead.py): a
CA and a node certificate it signs, for server and client use, naming 127.0.0.1, localhost and
splitserve-internal. EC P-256 keys: milliseconds each. Needs `cryptography` (a dev dependency);
a cluster gets its certificates from the Helm chart or cert-manager instead."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class NodeFiles:
    cert: Path
    key: Path
    ca: Path

    def env(self) -> dict[str, str]:
        """The SPLITSERVE_TLS_* variables a worker or gateway reads."""
        return {"SPLITSERVE_TLS_CERT": str(self.cert), "SPLITSERVE_TLS_KEY": str(self.key),
                "SPLITSERVE_TLS_CA": str(self.ca)}

    def flags(self) -> list[str]:
        return ["--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca)]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(folder: Path | str, name: str) -> NodeFiles:
    """A CA called `name` and one node certificate it signed, as PEM files in `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder().subject_name(_name(f"{name} CA")).issuer_name(_name(f"{name} CA"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    node_key = ec.generate_private_key(ec.SECP256R1())
    node_cert = (
        x509.CertificateBuilder().subject_name(_name(f"{name} node")).issuer_name(ca_cert.subject)
        .public_key(node_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(valid[0]).not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.DNSName("splitserve-internal"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                              ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = NodeFiles(folder / f"{name}.crt", folder / f"{name}.key", folder / f"{name}-ca.crt")
    files.cert.write_bytes(node_cert.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(_pem_key(node_key))
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return files
