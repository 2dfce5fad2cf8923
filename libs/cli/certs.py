"""A private CA and the certificates it signs, for TLS in tests and local stacks.

``dev_certs(folder)`` writes ``ca.pem``, a server certificate for ``localhost`` /
``127.0.0.1`` (nats-server, the gateway's HTTPS) and a client certificate (mutual TLS),
each key beside its certificate with mode 0600. Production certificates come from the
operator's own CA; nothing here is meant to be trusted beyond one machine.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CertFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> Any:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tandem (local)"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, cert: Any, key: Any) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = path.with_suffix(".key")
    key_path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    os.chmod(key_path, 0o600)


def dev_certs(folder: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
              days: int = 30) -> CertFiles:
    """A fresh CA, one server certificate for ``hosts`` and one client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    ca_key = _key()
    ca_name = _name("Tandem local CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(
              digital_signature=True, key_cert_sign=True, crl_sign=True,
              content_commitment=False, key_encipherment=False, data_encipherment=False,
              key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write(folder / "ca.pem", ca, ca_key)

    def issue(name: str, usage: Any, sans: list[Any]) -> None:
        key = _key()
        builder = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        _write(folder / f"{name}.pem", builder.sign(ca_key, hashes.SHA256()), key)

    sans: list[Any] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    issue("server", ExtendedKeyUsageOID.SERVER_AUTH, sans)
    issue("client", ExtendedKeyUsageOID.CLIENT_AUTH, [])
    return CertFiles(ca=folder / "ca.pem", server_cert=folder / "server.pem",
                     server_key=folder / "server.key", client_cert=folder / "client.pem",
                     client_key=folder / "client.key")
