"""Who connected, and who may: the server's audit log and its revocation list.

`Identity` is what the server knows of a stream's peer from its TLS certificate (subject, serial,
SHA-256 fingerprint). `AuditLog` appends one JSON line per connect, refusal, drop and revocation
to OUT/connections.jsonl, each line written whole by one `write` to a file opened for appending
(never a half line, whoever else writes). `Revocations` is `revoked=FILE`: one entry a line,
a client id (`3` or `client-3`) or a certificate serial (`serial=1A2B...`, in hex as
`openssl x509 -noout -serial` prints it; `#` starts a comment), re-read when the file changes.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes

from splitlab.errors import UserError
from splitlab.net.certs import client_name


@dataclass(frozen=True)
class Identity:
    """A stream's peer: its address and, from its certificate, who it is."""

    peer: str
    common_name: str | None = None
    subject: str = ""
    serial: str = ""
    fingerprint: str = ""

    @classmethod
    def of(cls, peer: str, auth: dict[str, list[bytes]]) -> Identity:
        pem = auth.get("x509_pem_cert")
        if not pem:
            return cls(peer)
        try:
            cert = x509.load_pem_x509_certificate(pem[0])
        except ValueError:
            return cls(peer)
        names = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        return cls(
            peer,
            str(names[0].value) if names else None,
            cert.subject.rfc4514_string(),
            f"{cert.serial_number:X}",
            cert.fingerprint(hashes.SHA256()).hex(),
        )


class AuditLog:
    """OUT/connections.jsonl, appended to (across resumes too: it is the operator's record)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def write(self, event: str, who: Identity, client: int | None = None, verb: str = "", reason: str = "") -> None:
        line = {
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "event": event,
            "peer": who.peer,
            "subject": who.subject,
            "serial": who.serial,
            "fingerprint": who.fingerprint,
            "client": client,
            "verb": verb,
            "reason": reason,
        }
        data = (json.dumps(line) + "\n").encode()
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)


_CLIENT = re.compile(r"(?:client-)?(\d+)")
_SERIAL = re.compile(r"serial=([0-9A-Fa-f:]+)")


class Revocations:
    """The revoked client ids and certificate serials of `revoked=FILE` (none without one)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.clients: frozenset[int] = frozenset()
        self.serials: frozenset[str] = frozenset()
        self._stamp: Any = None
        if path is not None:
            self.clients, self.serials = self._read(path)
            self._stamp = self._stat(path)

    def covers(self, who: Identity, client_id: int | None) -> bool:
        return (
            (client_id is not None and client_id in self.clients)
            or (who.serial in self.serials)
            or any(who.common_name == client_name(k) for k in self.clients)
        )

    def reload(self) -> str | None:
        """Re-read the file if it changed; a line saying what went wrong (the old list stays), or None."""
        if self.path is None or self._stat(self.path) == self._stamp:
            return None
        self._stamp = self._stat(self.path)
        try:
            self.clients, self.serials = self._read(self.path)
        except UserError as error:
            return f"{error}; the previous list stays in force"
        return None

    @staticmethod
    def _stat(path: Path) -> Any:
        try:
            stat = path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size, stat.st_ino

    @staticmethod
    def _read(path: Path) -> tuple[frozenset[int], frozenset[str]]:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"revoked={str(path)!r} cannot be read ({type(error).__name__}: {error})") from None
        clients, serials = set(), set()
        for number, line in enumerate(text.splitlines(), start=1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            if match := _CLIENT.fullmatch(entry):
                clients.add(int(match[1]))
            elif match := _SERIAL.fullmatch(entry):
                serials.add(match[1].replace(":", "").upper().lstrip("0") or "0")
            else:
                raise UserError(
                    f"revoked={str(path)!r} line {number}: {entry!r} is neither a client id (3 or client-3) "
                    f"nor a certificate serial (serial=1A2B...)"
                )
        return frozenset(clients), frozenset(serials)
