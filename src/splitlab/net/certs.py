"""Certificates for mutual TLS: a development CA, the server's certificate, one per client id.

`splitlab certs out=DIR clients=K [hosts=a,b]` writes `ca.pem` (and `ca.key`, which signs; keep it
off the machines that run nodes), `server.pem`/`server.key` (valid for localhost, 127.0.0.1 and
the given hosts) and `client-<k>.pem`/`client-<k>.key` for k < K, whose common name is
`client-<k>`: the server takes a client's id from its certificate, so a client cannot claim
another's. EC P-256 keys, valid for a year; private keys are written readable by the owner only.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitlab.errors import UserError

CA, SERVER = "ca", "server"
VALID_DAYS = 365


def client_name(client_id: int) -> str:
    """The common name of client `client_id`'s certificate, and its files' stem."""
    return f"client-{client_id}"


def make_certs(out: Path, clients: int, hosts: list[str]) -> list[Path]:
    """A CA, a server certificate for localhost, 127.0.0.1 and `hosts`, and client certificates."""
    if clients < 1:
        raise UserError(f"clients={clients}: a deployment needs at least one client")
    out.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "splitlab development CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
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
    written = [_write(out, CA, ca, ca_key)]
    names: list[x509.GeneralName] = []
    for host in ["localhost", "127.0.0.1", *hosts]:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    written.append(_leaf(out, SERVER, ca, ca_key, names, ExtendedKeyUsageOID.SERVER_AUTH))
    for k in range(clients):
        written.append(
            _leaf(out, client_name(k), ca, ca_key, [x509.DNSName(client_name(k))], ExtendedKeyUsageOID.CLIENT_AUTH)
        )
    return written


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _leaf(
    out: Path,
    name: str,
    ca: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    alt_names: list[x509.GeneralName],
    usage: x509.ObjectIdentifier,
) -> Path:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]), ca.subject, key.public_key())
        .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return _write(out, name, cert, key)


def _write(out: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Path:
    pem = out / f"{name}.pem"
    pem.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = out / f"{name}.key"
    key_path.touch(mode=0o600)
    os.chmod(key_path, 0o600)
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return pem


def read_pair(certs: Path, name: str) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, `name`'s certificate, `name`'s key) as PEM bytes; UserError naming a missing file."""
    paths = [certs / f"{CA}.pem", certs / f"{name}.pem", certs / f"{name}.key"]
    for path in paths:
        if not path.is_file():
            raise UserError(
                f"certificate file {str(path)!r} does not exist; make them with `splitlab certs out={certs}`"
            )
    ca, cert, key = (path.read_bytes() for path in paths)
    return ca, cert, key
