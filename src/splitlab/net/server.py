"""`splitlab server`'s transport (splitlab.engine.serve): the engine, with the client nodes in
other processes, reached over gRPC.

The server runs exactly what `splitlab run` runs (orchestration, training and sync servers,
evaluation, checkpoints, metrics); only the calls to client nodes go through `NetworkTransport`:
each becomes a CALL down the client's stream (splitlab.net.protocol), whose RESULT is decoded,
checked (splitlab.net.checks) and counted in the ledger as in-process. `Hub` owns the gRPC
server and one `Session` per connected client: mutual TLS, a client's id taken from its
certificate, one session per id, and a client is called only once its REPORT of the data
it holds fits the run (with data=own, those reports are where the clients' sizes come from):
a connection that ends before it reported is no client and no dropout (the run waits on for
the client), and a client whose report is refused stops and is waited for no more.
A client that disconnects, misses a deadline or its heartbeats, or sends anything the checks
refuse, is dropped (one log line) and reported to the algorithm as `ClientDropped`; it may
connect again and is then used from the next round on, its new node first given its kept state
(`NetworkTransport.on_rejoin`). A second connection with a connected client's certificate is
refused while the first is heard from, and replaces it if it is silent for two heartbeats (a
host that vanished without closing its connection comes back).

No client can stall the server: a stream must say HELLO within `hello_timeout`, a certificate
that is not a client's is refused before HELLO, one certificate holds at most
`streams_per_client` streams at once, and the worker pool holds that many per client (gRPC
refuses streams past it at once, RESOURCE_EXHAUSTED). `revoked=FILE` (splitlab.net.audit) is
re-read while the server runs; every connect, refusal, drop and revocation is a line of
OUT/connections.jsonl.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError
from pydantic import BaseModel, ConfigDict, Field, field_validator

from splitlab import codec
from splitlab.algorithms.vertical_sl import FeatureParty
from splitlab.config import RUN_CONTROL_KEYS, parse_settings
from splitlab.errors import UserError
from splitlab.ledger import Ledger
from splitlab.net import protocol
from splitlab.net.audit import AuditLog, Identity, Revocations
from splitlab.net.certs import SERVER, client_name, read_pair
from splitlab.net.checks import Checks, OwnPartyReports, Refused, held
from splitlab.resolve import resolve_config
from splitlab.roles import Blueprint
from splitlab.transport import KEYED, ClientDropped, Proxy, Transport, VerbSpec, as_message

logger = logging.getLogger(__name__)

MIB = 1 << 20
_BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED  # a refusal for now: the client backs off and tries again


class ServerSettings(BaseModel):
    """The server's own keys (not the run's: they are not stored in config.yaml)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    listen: str = Field("127.0.0.1:7070", description="HOST:PORT to listen on (0.0.0.0:PORT: every interface)")
    certs: Path = Field(Path("certs"), description="directory of ca.pem, server.pem and server.key")
    min_clients: int = Field(
        1, ge=1, le=1_000_000, description="fewest clients that must finish a round, or the run stops"
    )
    call_timeout: float = Field(120.0, gt=0, le=86_400, description="seconds a client has to answer one call")
    heartbeat: float = Field(
        2.0, gt=0, le=3_600, description="seconds between a client's heartbeats; 3 missed: dropped"
    )
    join_timeout: float = Field(
        300.0,
        gt=0,
        le=604_800,
        description="seconds from the start to wait for every client to join (until all have: also after one left)",
    )
    rejoin_wait: float = Field(
        5.0, ge=0, le=86_400, description="seconds a round waits for a sampled client that is away"
    )
    max_message_mib: int = Field(
        1024,
        ge=1,
        le=protocol.MAX_MESSAGE_MIB,
        description="largest message accepted, in MiB (past chunk_kib it comes in chunks)",
    )
    chunk_kib: int = Field(
        65_536,
        ge=1,
        le=protocol.MAX_CHUNK_KIB,
        description="messages larger than this many KiB go in chunks of it, both ways (gRPC carries < 2 GiB at once)",
    )
    hello_timeout: float = Field(10.0, gt=0, le=3_600, description="seconds a new stream has to say HELLO")
    streams_per_client: int = Field(2, ge=1, le=64, description="streams one certificate may hold open at once")
    revoked: Path | None = Field(
        None, description="file of revoked client ids / certificate serials (serial=HEX), re-read while running"
    )

    @field_validator("listen")
    @classmethod
    def _listen(cls, value: str) -> str:
        return protocol.host_port(value, "listen")


def split_settings(raw: Mapping[str, Any], settings_class: type[BaseModel]) -> tuple[BaseModel, dict[str, Any]]:
    """(the command's own settings, the run's config) from one flat set of KEY=VALUE settings."""
    own = {k: v for k, v in raw.items() if k in settings_class.model_fields}
    return parse_settings(settings_class, own), {k: v for k, v in raw.items() if k not in own}


def log(line: str) -> None:
    logger.info(f"splitlab server: {line}")


class Session:
    """One client's connection: messages to send, replies received, and whether it is alive."""

    def __init__(self, client_id: int, who: Identity) -> None:
        self.client_id, self.who, self.peer = client_id, who, who.peer
        self.outgoing: queue.Queue[Any] = queue.Queue()
        self.replies: queue.Queue[Any] = queue.Queue()
        self.since = self.last_seen = time.monotonic()
        self.heard = threading.Event()  # set by every message from the client (and when it ends)
        self.awaited: int | None = None  # the sequence number of the call waiting for a reply
        self.alive = True
        self.reported = False  # its REPORT was accepted: it may be called
        self.called = False  # the run has called it (Hub.first_call)
        self.reason = ""
        self.refusal = ""  # why it is refused (its stream ends with that, and the client stops)

    def close(self, reason: str) -> bool:
        """End the session (the first reason counts); whether it was alive."""
        if not self.alive:
            return False
        self.alive, self.reason = False, reason
        self.heard.set()
        self.outgoing.put(None)
        self.replies.put(None)
        return True


class Hub:
    """The gRPC server and the client sessions; calls a client and waits for its reply."""

    def __init__(self, settings: ServerSettings, client_config: dict[str, Any], audit: AuditLog) -> None:
        self.settings, self.audit = settings, audit
        self.revocations = Revocations(settings.revoked)
        self._streams: dict[str, int] = {}  # open streams by certificate fingerprint
        self.run_id = uuid.uuid4().hex
        self.max_bytes = settings.max_message_mib * MIB
        self.chunk_bytes = settings.chunk_kib * 1024
        welcome = {"config": client_config, "heartbeat": settings.heartbeat, "chunk_bytes": self.chunk_bytes}
        self._welcome = codec.encode(welcome)
        self._clients = client_config["clients"]  # K, or "all" (known once the dataset is read)
        self._sessions: dict[int, Session] = {}  # each id's newest session: the one the run may call
        self._called: set[int] = set()  # ids whose node the run has called: a new node of theirs is fresh
        self._reported: set[int] = set()  # ids whose data was accepted at least once
        self._refusals: dict[int, str] = {}  # ids whose last session was refused (they stop), and why
        self._expected: set[int] | None = None
        self._summaries: dict[int, dict[str, Any]] = {}  # what each client must report of its data
        self._checks: Checks | OwnPartyReports | None = None
        self._changed = threading.Condition()
        self._seq = itertools.count(1)
        self._wire_lock = threading.Lock()
        self.ledger: Ledger | None = None
        self._unaccounted_wire = 0
        self._server: grpc.Server | None = None
        self._join_deadline = 0.0
        self._closing = False

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        ca, cert, key = read_pair(self.settings.certs, SERVER)
        credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        handler = grpc.method_handlers_generic_handler(
            protocol.METHOD.split("/")[1],
            {
                protocol.METHOD.split("/")[2]: grpc.stream_stream_rpc_method_handler(
                    self._connect, request_deserializer=self._parse, response_serializer=self._serialize
                )
            },
        )
        grpc_limit = min(2 * self.max_bytes, protocol.GRPC_MAX_BYTES)  # up to 2x: refused by _parse, with the reason
        options = [
            *protocol.grpc_options(grpc_limit),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ("grpc.server_handshake_timeout_ms", int(1000 * self.settings.hello_timeout)),
        ]
        clients = self._clients if isinstance(self._clients, int) else 4096
        streams = 8 + clients * self.settings.streams_per_client  # one worker per stream; gRPC refuses more
        workers = ThreadPoolExecutor(max_workers=streams)
        self._server = grpc.server(workers, handlers=[handler], options=options, maximum_concurrent_rpcs=streams)
        try:
            port = self._server.add_secure_port(self.settings.listen, credentials)
        except RuntimeError:
            port = 0
        if port == 0:
            raise UserError(f"cannot listen on listen={self.settings.listen!r}: not HOST:PORT, or the port is taken")
        self._server.start()
        self._join_deadline = time.monotonic() + self.settings.join_timeout
        if self.settings.revoked is not None:
            threading.Thread(target=self._watch_revocations, daemon=True).start()
        log(f"listening on {self.settings.listen} (mutual TLS, run {self.run_id})")

    def expect(
        self, summaries: Mapping[int, dict[str, Any] | None], ledger: Ledger, checks: Checks | OwnPartyReports
    ) -> None:
        """The run's clients, all at once (the transport says so as it is built; a client admitted
        in between would be refused as not belonging to the run): client k must report holding the
        data `summaries[k]` describes (`data_summary`; None: what it first reports, data=own)."""
        with self._changed:
            self._expected = (self._expected or set()) | set(summaries)
            self.ledger, self._checks = ledger, checks
            self._summaries.update({k: summary for k, summary in summaries.items() if summary is not None})
            self._changed.notify_all()

    def reported_counts(self) -> list[list[int]]:
        """Every client's class counts, once all have reported (data=own), waiting until join_timeout."""
        return [summary["class_counts"] for summary in self.reported().values()]  # classification datasets only

    def reported(self) -> dict[int, dict[str, Any]]:
        """Every client's summary of its data, once all have reported (data=own), waiting until
        join_timeout; UserError at once when one is refused (it stops: the run cannot be planned)."""
        with self._changed:
            ids = sorted(self._expected or ())
            remaining = max(0.0, self._join_deadline - time.monotonic())
            refused = lambda: [k for k in ids if k in self._refusals and k not in self._reported]
            done = lambda: self._reported.issuperset(ids) or self._closing or bool(refused())
            self._changed.wait_for(done, timeout=remaining)
            missing = [k for k in ids if k not in self._reported]
            rejected = refused()
            why = {k: self._refusals[k] if k in rejected else self._absence(k) for k in missing}
        needed = "with data=own the server needs every client's data before round 1"
        if rejected:
            raise UserError(f"client {rejected[0]} was refused ({why[rejected[0]]}); {needed}")
        if missing:
            raise UserError(
                f"client(s) {'; '.join(f'{k} ({why[k]})' for k in missing)} did not report their data within "
                f"join_timeout={self.settings.join_timeout:g} s; {needed}"
            )
        return {k: self._summaries[k] for k in ids}

    def _absence(self, client_id: int) -> str:
        """Why a client is not there to be called: never connected, or connected without a report."""
        session = self._sessions.get(client_id)
        if session is not None and session.alive:
            return f"connected {time.monotonic() - session.since:.1f} s ago but has not reported its data"
        return "not connected"

    def close(self) -> None:
        """The run is over (or failed): BYE to every client, then stop."""
        with self._changed:
            self._closing = True
            sessions = list(self._sessions.values())
            self._changed.notify_all()
        for session in sessions:
            session.outgoing.put(protocol.envelope(protocol.BYE, self.run_id))
            session.close("the run is over")
        if self._server is not None:
            self._server.stop(grace=5).wait()

    # --- wire accounting -------------------------------------------------------------------------
    def _count_wire(self, nbytes: int) -> None:
        with self._wire_lock:
            if self.ledger is None:
                self._unaccounted_wire += nbytes
            else:
                self.ledger.wire_bytes += nbytes + self._unaccounted_wire
                self._unaccounted_wire = 0

    def _serialize(self, message: Any) -> bytes:
        data = message.SerializeToString()
        self._count_wire(len(data))
        return data

    def _parse(self, data: bytes) -> Any:
        """The envelope in `data`, or an INVALID one saying why not (a raised error would end the
        stream without a reason; gRPC itself refuses what is over twice the limit)."""
        self._count_wire(len(data))
        if len(data) > self.max_bytes:
            why = f"a message of {len(data)} bytes, over max_message_mib={self.settings.max_message_mib}"
            return protocol.envelope(protocol.INVALID, error=why)
        try:
            return protocol.Envelope.FromString(data)
        except DecodeError:
            return protocol.envelope(protocol.INVALID, error=f"{len(data)} bytes that are not a protobuf Envelope")

    # --- a client's stream ---------------------------------------------------------------------
    def _connect(self, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        who = Identity.of(context.peer(), context.auth_context())
        for step, code in (self._identify, grpc.StatusCode.PERMISSION_DENIED), (self._open_stream, _BUSY):
            try:
                step(who)
            except Refused as refusal:
                self._refused(who, str(refusal))
                context.abort(code, str(refusal))
        try:
            yield from self._stream(who, requests, context)
        finally:
            with self._changed:
                self._streams[who.fingerprint] -= 1

    def _identify(self, who: Identity) -> None:
        """Refused (for good) if the stream's certificate is not a client's, or is revoked."""
        if who.common_name is None or not re.fullmatch(r"client-\d+", who.common_name):
            raise Refused(f"its certificate is {who.common_name!r}'s, not a client's")
        if self.revocations.covers(who, None):
            raise Refused(f"the certificate of {who.common_name} (serial {who.serial}) is revoked")

    def _open_stream(self, who: Identity) -> None:
        """Count a new stream of `who`'s; Refused (for now) if its certificate already holds
        `streams_per_client` streams: before any worker waits for its HELLO."""
        with self._changed:
            if self._streams.get(who.fingerprint, 0) >= self.settings.streams_per_client:
                raise Refused(
                    f"{who.common_name} already holds streams_per_client={self.settings.streams_per_client} streams"
                )
            self._streams[who.fingerprint] = self._streams.get(who.fingerprint, 0) + 1

    def _stream(self, who: Identity, requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        timed_out = threading.Event()

        def cancel() -> None:  # no HELLO in time: the stream ends, its worker is free
            timed_out.set()
            context.cancel()

        late = threading.Timer(self.settings.hello_timeout, cancel)
        late.start()
        try:
            hello = next(requests)
        except Exception as error:  # the stream broke before HELLO (far too large, gone, or late)
            why = "no HELLO within hello_timeout" if timed_out.is_set() else _first_line(error)
            self._refused(who, f"its stream broke before HELLO ({why})")
            return
        finally:
            late.cancel()
        try:
            session, replaced = self._admit(hello, who)
        except Refused as refusal:
            self._refused(who, str(refusal), hello.client_id)
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(refusal))
        if replaced is not None:
            replaced.refusal = f"replaced by a newer connection with the same certificate (from {who.peer})"
            self.drop(replaced, replaced.refusal)
        log(f"client {session.client_id} connected from {who.peer}")
        self.audit.write("connect", who, session.client_id)
        threading.Thread(target=self._read, args=(session, requests), daemon=True).start()
        yield from protocol.chunked(
            protocol.envelope(protocol.WELCOME, self.run_id, payload=self._welcome), self.chunk_bytes
        )
        try:
            while (message := session.outgoing.get()) is not None:
                yield from protocol.chunked(message, self.chunk_bytes)
            if session.refusal:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, session.refusal)
        finally:
            self._leave(session, "its stream ended")

    def _refused(self, who: Identity, reason: str, client_id: int | None = None) -> None:
        log(f"refused {who.peer}: {reason}")
        self.audit.write("refusal", who, client_id, reason=reason)

    def _admit(self, hello: Any, who: Identity) -> tuple[Session, Session | None]:
        """The new session of the client saying `hello`, and the live one it replaces, if any: one
        session per client. A second connection with the certificate of a connected client is
        refused if the connected one is heard from within two heartbeats (the accepted session
        goes on undisturbed), and replaces it if not (its host vanished without closing it)."""
        if hello.kind == protocol.INVALID:
            raise Refused(hello.error)
        if hello.kind != protocol.HELLO:
            raise Refused(f"expected HELLO, got message kind {hello.kind}")
        if hello.version != protocol.PROTOCOL_VERSION:
            raise Refused(f"protocol version {hello.version}; this server speaks {protocol.PROTOCOL_VERSION}")
        client_id = hello.client_id
        if who.common_name != client_name(client_id):
            raise Refused(f"client_id={client_id}, but its certificate is {who.common_name!r}'s")
        with self._changed:
            ready = lambda: self._expected is not None or self._closing
            self._changed.wait_for(ready, timeout=self.settings.join_timeout)
            if self._closing:
                raise Refused("the server is shutting down")
            expected = self._expected or set()
            if client_id not in expected:
                raise Refused(f"client_id={client_id} is not a client of this run (0 to {len(expected) - 1})")
            if self.revocations.covers(who, client_id):
                raise Refused(f"client {client_id} is revoked")
            current = self._sessions.get(client_id)
        arrived = time.monotonic()
        if current is not None and current.alive:
            current.heard.clear()
            current.heard.wait(2 * self.settings.heartbeat)
        with self._changed:
            if self._closing:  # closed while it waited: `close` told the sessions it knew, not this one
                raise Refused("the server is shutting down")
            current = self._sessions.get(client_id)
            if current is not None and current.alive and current.last_seen >= arrived:
                raise Refused(
                    f"client {client_id} is already connected (from {current.peer}) and answering; "
                    f"one connection per client"
                )
            session = Session(client_id, who)
            self._sessions[client_id] = session  # at once: whoever waits for the client now waits for this one
            self._refusals.pop(client_id, None)
            self._changed.notify_all()
        return session, current if current is not None and current.alive else None

    def _watch_revocations(self) -> None:
        """Re-read `revoked=FILE` every second; drop every connected client it now revokes."""
        while not self._closing:
            time.sleep(1.0)
            problem = self.revocations.reload()
            if problem is not None:
                log(problem)
            with self._changed:
                sessions = list(self._sessions.values())
            for session in sessions:
                if session.alive and self.revocations.covers(session.who, session.client_id):
                    self.audit.write("revocation", session.who, session.client_id, reason="revoked while connected")
                    session.refusal = f"client {session.client_id} is revoked"
                    self.drop(session, session.refusal)

    def _report(self, session: Session, message: Any) -> None:
        """A client's REPORT of its data: checked, and the client may then be called; or refused."""
        assert self._checks is not None  # set before any client is admitted
        client_id = session.client_id
        try:
            summary = self._checks.report(
                codec.decode(bytes(message.payload)), self._summaries.get(client_id), client_id
            )
        except (codec.MessageError, Refused) as refusal:
            log(f"refused client {client_id}'s data: {refusal}")
            session.refusal = f"its data: {refusal}"
            session.close(session.refusal)
            return
        with self._changed:
            if self._sessions.get(client_id) is not session or not session.alive:
                return  # replaced (or dropped) while it built its node: the newer session reports its own
            self._summaries[client_id] = summary
            session.reported = True
            self._reported.add(client_id)
            self._changed.notify_all()
        log(f"client {client_id} holds {held(summary)}")

    def _read(self, session: Session, requests: Iterator[Any]) -> None:
        """Replies and heartbeats from the client, until its stream ends."""
        chunks = protocol.Assembler(
            self.max_bytes, f"max_message_mib={self.settings.max_message_mib}", self.chunk_bytes
        )
        try:
            for piece in requests:
                session.last_seen = time.monotonic()
                session.heard.set()
                try:
                    message = chunks.add(piece)
                except protocol.ChunkError as error:
                    self.drop(session, str(error))
                    break
                if message is None:
                    continue
                if message.kind == protocol.INVALID:
                    self.drop(session, message.error)
                elif message.version != protocol.PROTOCOL_VERSION or message.run_id != self.run_id:
                    self.drop(session, f"message of protocol {message.version}, run {message.run_id!r}")
                elif message.kind == protocol.REPORT and not session.reported:
                    self._report(session, message)
                elif message.kind in (protocol.RESULT, protocol.ERROR) and message.seq == session.awaited:
                    session.replies.put(message)
                elif message.kind in (protocol.RESULT, protocol.ERROR):
                    self.drop(session, f"a reply to call {message.seq}, which is not the call waiting")
                elif message.kind != protocol.HEARTBEAT:
                    self.drop(session, f"unexpected message kind {message.kind}")
        except Exception as error:  # too large, not protobuf, connection lost
            self.drop(session, f"its stream failed ({_first_line(error)})")
        self._leave(session, "it disconnected")

    def _leave(self, session: Session, reason: str) -> None:
        """The session's stream ended. If it was the client's newest, the client is away; and if it
        was refused, it stops: nobody waits for it until it connects again (its slot is free)."""
        if session.close(reason):
            log(f"client {session.client_id} left: {reason}")
            self.audit.write("drop", session.who, session.client_id, reason=reason)
        with self._changed:
            if self._sessions.get(session.client_id) is session:
                del self._sessions[session.client_id]
                if session.refusal:
                    self._refusals[session.client_id] = session.refusal
            self._changed.notify_all()

    def drop(self, session: Session, reason: str, verb: str = "") -> None:
        if session.close(reason):
            log(f"dropped client {session.client_id}: {reason}")
            self.audit.write("drop", session.who, session.client_id, verb, reason)

    # --- calls ---------------------------------------------------------------------------------
    def session(self, client_id: int) -> Session:
        """The client's newest session once it has reported its data, waiting for it to connect and
        report; ClientDropped (one line: who and why) if it does not. The join phase lasts until
        every client has reported once or been refused, at most join_timeout from the start: during
        it a client that is away (never came, or left) is waited for until its end; after it,
        rejoin_wait. A connection that has not reported yet is given call_timeout from its start (it
        may be building its node); if it ends first (a handshake cut short, or replaced by a newer
        connection with the same certificate), the wait goes on for the client, not for it. A
        refused client (it stops) and a revoked one are not waited for."""
        start = time.monotonic()
        with self._changed:
            while True:
                session = self._sessions.get(client_id)
                if session is not None and not session.alive:
                    session = None
                if session is not None and session.reported:
                    return session
                if client_id in self.revocations.clients:
                    why = "it is revoked"
                elif client_id in self._refusals and session is None:
                    why = f"it was refused ({self._refusals[client_id]})"
                elif self._closing:
                    why = "the server is shutting down"
                else:
                    give_up = self._give_up_at(start)
                    if session is not None:
                        give_up = max(give_up, session.since + self.settings.call_timeout)
                    left = give_up - time.monotonic()
                    if left > 0:
                        self._changed.wait(left)  # woken by every connect, report and leave
                        continue
                    why = self._absence(client_id)
                    if session is not None:
                        why += f", call_timeout={self.settings.call_timeout:g} s"
                break
        log(f"client {client_id} is left out of this round: {why} (waited {time.monotonic() - start:.1f} s)")
        raise ClientDropped(client_id, why)

    def _give_up_at(self, start: float) -> float:
        """When a wait begun at `start` for an absent client ends: rejoin_wait after it, or in the
        join phase (not every client has reported once or been refused yet) not before join_timeout
        is up."""
        settled = self._reported | set(self._refusals) | self.revocations.clients
        joined = self._expected is not None and settled.issuperset(self._expected)
        return (
            start + self.settings.rejoin_wait if joined else max(start + self.settings.rejoin_wait, self._join_deadline)
        )

    def first_call(self, session: Session) -> bool:
        """Whether the run is about to call `session` for the first time although it has called an
        earlier node of the client's: a fresh node, which must first get the client's kept state
        (`NetworkTransport.on_rejoin`). A connection the run never called (its handshake cut
        short, replaced before it reported) leaves no trace: the next is not a rejoin."""
        with self._changed:
            rejoined = not session.called and session.client_id in self._called
            session.called = True
            self._called.add(session.client_id)
        return rejoined

    def call(self, session: Session, verb: str, payload: bytes) -> bytes:
        """Send a CALL and wait for its RESULT; ClientDropped if the client errs, leaves or is late."""
        client_id = session.client_id
        seq = next(self._seq)
        session.awaited = seq
        session.outgoing.put(protocol.envelope(protocol.CALL, self.run_id, seq=seq, verb=verb, payload=payload))
        settings = self.settings
        deadline = time.monotonic() + settings.call_timeout
        while True:
            try:
                reply = session.replies.get(timeout=settings.heartbeat)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline:
                    self.drop(session, f"no reply to {verb} within call_timeout={settings.call_timeout:g} s", verb)
                elif now - session.last_seen > 3 * settings.heartbeat:
                    self.drop(session, f"no heartbeat for {now - session.last_seen:.1f} s", verb)
                continue
            if reply is None:
                raise ClientDropped(client_id, session.reason)
            if reply.seq != seq:  # a second reply to an earlier call
                self.drop(session, f"a reply to call {reply.seq} while call {seq} ({verb}) was waiting", verb)
            elif reply.kind == protocol.ERROR:
                self.drop(session, f"its {verb} failed: {reply.error}", verb)
            else:
                return bytes(reply.payload)

    def refuse(self, session: Session, verb: str, reason: str) -> None:
        """A result failed its checks: the session that sent it is dropped (not a newer one)."""
        log(f"refused the result of {verb} from client {session.client_id}: {reason}")
        if session.close(f"its {verb} result was refused"):
            self.audit.write("refusal", session.who, session.client_id, verb, reason)

    def expel(self, client_id: int, reason: str) -> None:
        """The run drops the client (its data broke the server's step): its stream ends with the
        reason; it may connect again, and is then used from the next round on."""
        session = self._sessions.get(client_id)
        if session is not None:
            session.refusal = reason
            self.drop(session, reason)


def _first_line(error: BaseException) -> str:
    code = getattr(error, "code", None)
    if callable(code) and code() is not None:
        return f"{code()}: {error.details()}"[:300]  # type: ignore[attr-defined]
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"[:300]


class RemoteProxy(Proxy):
    """A client node in another process, as the algorithm sees it: its verbs, nothing else."""

    def __init__(self, transport: NetworkTransport, client_id: int, role_class: type) -> None:
        super().__init__(transport, None, counted=True)
        self._client_id, self._role_class = client_id, role_class

    def __getattr__(self, name: str) -> Callable[..., Any]:
        spec = getattr(getattr(self._role_class, name, None), "__verb__", None)
        if spec is None:
            raise AttributeError(
                f"{self._role_class.__name__}.{name} is not a verb; roles are reached only through their verbs"
            )
        transport: NetworkTransport = self._transport  # type: ignore[assignment]

        def call(*args: Any, **kwargs: Any) -> Any:
            result = transport.remote_call(self._client_id, name, spec, *args, **kwargs)
            return as_message(f"{self._role_class.__name__}.{name}", result) if spec.up == KEYED else result

        setattr(self, name, call)
        return call


class NetworkTransport(Transport):
    """Calls to client nodes go over the network; the training and sync servers are in this process."""

    name = "network"
    remote = True

    def __init__(self, ledger: Ledger, device: torch.device, hub: Hub) -> None:
        super().__init__(ledger, device)
        self.hub = hub
        self.min_clients = hub.settings.min_clients
        self.checks: Checks | None = None

    def connect_remote(
        self, role_classes: Mapping[int, type], blueprint: Blueprint, summaries: Mapping[int, dict[str, Any] | None]
    ) -> dict[int, Proxy]:
        parties = all(issubclass(role_class, FeatureParty) for role_class in role_classes.values())
        self.checks = self.checks or Checks(blueprint, parties)
        for k, summary in summaries.items():
            if summary is not None and "samples" in summary:  # a vertical party's rows (data=own: reported)
                self.checks.holds(k, summary["samples"])
        self.hub.expect(summaries, self.ledger, self.checks)
        return {k: RemoteProxy(self, k, role_class) for k, role_class in role_classes.items()}

    def reported_counts(self) -> list[list[int]]:
        return self.hub.reported_counts()

    def reports_to_plan(self, nodes: int) -> dict[int, dict[str, Any]]:
        """What every node of a run with its own files (data=own) reports of them, once all have,
        checked as the reports a plan is made from (a vertical party's columns, rows and test ids)."""
        self.hub.expect(dict.fromkeys(range(nodes)), self.ledger, OwnPartyReports())
        return self.hub.reported()

    def drop(self, client_id: int, reason: str) -> None:
        self.hub.expel(client_id, reason)

    def remote_call(self, client_id: int, verb: str, spec: VerbSpec, *args: Any, **kwargs: Any) -> Any:
        session = self.hub.session(client_id)
        if self.hub.first_call(session):
            self.on_rejoin(client_id)  # its own calls reach this session (or, if it is gone, fail)
        self._count(spec.down, args, (args, kwargs), client_id)
        request = codec.encode({"args": list(args), "kwargs": kwargs})
        reply = self.hub.call(session, verb, request)
        self.ledger.envelope_bytes += len(request) + len(reply)
        try:
            result = codec.decode(reply, self.device)
            assert self.checks is not None
            self.checks.result(verb, spec, args, result, client_id)
        except (codec.MessageError, Refused) as refusal:
            self.hub.refuse(session, verb, str(refusal))
            raise ClientDropped(client_id, f"refused its {verb} result") from None
        self._count(spec.up, args, result, client_id)
        return result


def client_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What a client needs of the run's config to build its node: everything but how the server runs."""
    return {k: v for k, v in resolve_config(raw).as_dict().items() if k not in RUN_CONTROL_KEYS}
