"""Certificates for mutual TLS: a development CA, the server's certificate, one per client id.

`splitlab certs out=DIR clients=K [hosts=a,b]` writes `ca.pem` (and `ca.key`, which signs; keep it
off the machines that run nodes), `server.pem`/`server.key` (valid for localhost, 127.0.0.1 and
the given hosts) and `client-<k>.pem`/`client-<k>.key` for k < K, whose common name is
`client-<k>`: the server takes a client's id from its certificate, so a client cannot claim
another's. EC P-256 keys, valid for a year; private keys are written readable by the owner only.
An existing CA is never replaced unless asked (`overwrite=true`): every key it issued would stop
working; when it is replaced, the client certificates and keys it issued that are not issued
again (ids past the new `clients`) are removed, so no key of the old CA is left to hand out.
Host names are DNS names (non-ASCII ones in their IDNA form) or IP addresses.

`read_pair` checks what a node is started with before it listens or dials: every file readable
and PEM, the key the certificate's, the certificate signed by the CA and valid now; one line
naming the file and the cause otherwise.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import BaseModel, ConfigDict, Field

from splitlab.errors import UserError

CA, SERVER = "ca", "server"
VALID_DAYS = 365


class CertsSettings(BaseModel):
    """The `splitlab certs` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    out: Path = Field(Path("certs"), description="directory to write ca, server and client certificates and keys to")
    clients: int = Field(
        1,
        ge=1,
        le=1000,
        description="how many client certificates (each a certificate and key, made one by one)",
    )
    hosts: str | None = Field(
        None, description="names or addresses, comma-separated, the server certificate is also valid for"
    )
    overwrite: bool = Field(False, description="replace an existing CA (every key it issued stops working)")


def client_name(client_id: int) -> str:
    """The common name of client `client_id`'s certificate, and its files' stem."""
    return f"client-{client_id}"


def make_certs(out: Path, clients: int, hosts: list[str], overwrite: bool = False) -> list[Path]:
    """A CA, a server certificate for localhost, 127.0.0.1 and `hosts`, and client certificates."""
    if clients < 1:
        raise UserError(f"clients={clients}: a deployment needs at least one client")
    names = [host_name(host) for host in ["localhost", "127.0.0.1", *hosts]]
    if out.exists() and not out.is_dir():
        raise UserError(f"out={str(out)!r} is a file, not a directory; choose another out=")
    if (out / f"{CA}.pem").exists() and not overwrite:
        raise UserError(
            f"{str(out / f'{CA}.pem')!r} exists: a new CA would make every key it issued useless; "
            f"use overwrite=true to replace it, or another out="
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UserError(f"out={str(out)!r} cannot be made a directory ({error.strerror})") from None
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
    written.append(_leaf(out, SERVER, ca, ca_key, names, ExtendedKeyUsageOID.SERVER_AUTH))
    for k in range(clients):
        written.append(
            _leaf(out, client_name(k), ca, ca_key, [x509.DNSName(client_name(k))], ExtendedKeyUsageOID.CLIENT_AUTH)
        )
    for stale in out.iterdir():  # the old CA's client keys that were not reissued: useless, and misleading
        if re.fullmatch(r"client-\d+\.(pem|key)", stale.name) and stale.with_suffix(".pem") not in written:
            stale.unlink()
    return written


_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_name(host: str) -> x509.GeneralName:
    """`host` as a certificate's subject alternative name: an IP address, or a DNS name (its IDNA
    form if not ASCII); UserError for anything else."""
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        name = host.encode("idna").decode("ascii")
    except UnicodeError:
        name = ""
    labels = name.rstrip(".").split(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise UserError(f"hosts: {host!r} is neither an IP address nor a DNS name (letters, digits, '-', dots)")
    return x509.DNSName(name)


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
    """(CA certificate, `name`'s certificate, `name`'s key) as PEM bytes, checked; UserError naming
    the file and the cause (missing, unreadable, not PEM, a key not the certificate's, a
    certificate the CA did not sign or not valid now)."""
    paths = [certs / f"{CA}.pem", certs / f"{name}.pem", certs / f"{name}.key"]
    contents = []
    for path in paths:
        if not path.is_file():
            raise UserError(
                f"certificate file {str(path)!r} does not exist; make them with `splitlab certs out={certs}`"
            )
        try:
            contents.append(path.read_bytes())
        except OSError as error:
            raise UserError(f"certificate file {str(path)!r} cannot be read ({error.strerror})") from None
    ca_pem, cert_pem, key_pem = contents
    ca, cert = (_certificate(path, pem) for path, pem in zip(paths[:2], contents[:2]))
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as error:
        raise UserError(f"key file {str(paths[2])!r} is not an unencrypted PEM private key ({error})") from None
    if key.public_key() != cert.public_key():
        raise UserError(f"key file {str(paths[2])!r} is not the key of {str(paths[1])!r}")
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise UserError(f"certificate {str(paths[1])!r} was not signed by the CA in {str(paths[0])!r}") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    for path, each in zip(paths, (ca, cert)):
        if not each.not_valid_before_utc <= now <= each.not_valid_after_utc:
            raise UserError(
                f"certificate {str(path)!r} is valid from {each.not_valid_before_utc:%Y-%m-%d %H:%M} to "
                f"{each.not_valid_after_utc:%Y-%m-%d %H:%M} UTC, not now"
            )
    return ca_pem, cert_pem, key_pem


def _certificate(path: Path, pem: bytes) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as error:
        raise UserError(f"certificate file {str(path)!r} is not a PEM certificate ({error})") from None
