"""`splitlab client`: one client node, answering the server's verb calls over gRPC.

The client connects (mutual TLS, its own certificate), says HELLO with its id, and builds its
node from the config the server sends back and its own data: every training sample in its
`data_dir` (data=own), or the named dataset read from its `data_dir`, of which it keeps only its
partition (data=partition). It reports what it holds (REPORT: samples per class, their shape),
then answers every CALL with the verb's result and sends a heartbeat every few seconds. When
the stream breaks (the server restarts, the network fails, the server dropped it), it connects
again and builds a fresh node, backing off while the server is unreachable, busy
(RESOURCE_EXHAUSTED: its streams are taken) or silent (no WELCOME within `welcome_seconds`), for
up to `retry_seconds`; BYE ends it; a refusal (its data, its id, a revoked certificate, another
connection with its certificate) stops it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import grpc
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from splitlab import codec
from splitlab.errors import UserError
from splitlab.net import protocol
from splitlab.net.certs import client_name, read_pair
from splitlab.net.checks import Refused, check_finite, data_report
from splitlab.privacy import keys
from splitlab.roles import ClientNode

logger = logging.getLogger(__name__)

MIB = 1 << 20


class ClientSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    connect: str = Field("127.0.0.1:7070", description="the server's HOST:PORT")
    client_id: int = Field(0, ge=0, le=999_999, description="this client's id (its certificate must be client-<id>'s)")
    certs: Path = Field(Path("certs"), description="directory of ca.pem, client-<id>.pem and client-<id>.key")
    data_dir: str | None = Field(None, description="where this client's dataset files are (default: the run's)")
    data: Literal["partition", "own"] = Field(
        "partition", description="own: data_dir holds this client's own samples | partition: the whole dataset"
    )
    device: str = Field("cpu", description="cpu | cuda")
    threads: int | None = Field(None, ge=1, le=1024, description="torch threads (default: torch's)")
    server_name: str | None = Field(None, description="name in the server's certificate, if not the host")
    retry_seconds: float = Field(120.0, ge=0, le=604_800, description="how long to keep trying to (re)connect")
    welcome_seconds: float = Field(600.0, gt=0, le=604_800, description="how long a connection waits for WELCOME")
    max_message_mib: int = Field(
        1024,
        ge=1,
        le=protocol.MAX_MESSAGE_MIB,
        description="largest message accepted, in MiB (past the server's chunk_kib it comes in chunks)",
    )

    @field_validator("connect")
    @classmethod
    def _connect(cls, value: str) -> str:
        return protocol.host_port(value, "connect")


def log(client_id: int, line: str) -> None:
    logger.info(f"splitlab client {client_id}: {line}")


class _Finished(Exception):
    """The server said BYE."""


class _Silent(Exception):
    """The server took the stream but sent no WELCOME within welcome_seconds (a server that hangs,
    or a call gRPC never completes: one on a connection that broke as the call began)."""


def run_client(settings: ClientSettings) -> int:
    """Serve the run until the server says BYE (0), refuses this client (2), or stays away (1)."""
    if settings.data == "own" and settings.data_dir is None:
        raise UserError("data=own needs data_dir=DIR, the folder of this client's own files")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    ca, cert, key = read_pair(settings.certs, client_name(settings.client_id))
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    options: list[tuple[str, Any]] = protocol.grpc_options(settings.max_message_mib * MIB)
    if settings.server_name:
        options.append(("grpc.ssl_target_name_override", settings.server_name))
    last_contact, last_error, failures = time.monotonic(), "", 0
    while True:
        with grpc.secure_channel(settings.connect, credentials, options=options) as channel:
            connect = channel.stream_stream(
                protocol.METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=protocol.Envelope.FromString,
            )
            try:
                if _session(settings, connect):
                    last_contact, failures = time.monotonic(), 0
            except _Finished:
                log(settings.client_id, "the run is over")
                return 0
            except (grpc.RpcError, _Silent) as error:
                if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.PERMISSION_DENIED:
                    raise UserError(f"the server refused client {settings.client_id}: {error.details()}") from None
                why = str(error) if isinstance(error, _Silent) else error.details()
                if why != last_error:  # once per kind of failure, not once per retry
                    last_error = why
                    log(settings.client_id, f"cannot reach {settings.connect} ({why}); retrying")
        if time.monotonic() - last_contact > settings.retry_seconds:
            log(settings.client_id, f"no server at {settings.connect} for {settings.retry_seconds:g} s; giving up")
            return 1
        failures += 1
        time.sleep(min(8.0, 0.25 * 2**failures))  # backoff: a busy server (RESOURCE_EXHAUSTED) is not hammered


def _session(settings: ClientSettings, connect: Any) -> bool:
    """One connection, until its stream ends; whether the server welcomed this client."""
    outgoing: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    chunk_bytes = protocol.GRPC_MAX_BYTES  # until WELCOME gives the server's: only HELLO goes before
    chunks = protocol.Assembler(settings.max_message_mib * MIB, f"max_message_mib={settings.max_message_mib}")

    def requests() -> Iterator[Any]:
        while (message := outgoing.get()) is not None:
            yield from protocol.chunked(message, chunk_bytes)

    outgoing.put(protocol.envelope(protocol.HELLO, client_id=settings.client_id))
    replies = connect(requests())
    silent = threading.Event()

    def give_up() -> None:
        silent.set()
        replies.cancel()

    late = threading.Timer(settings.welcome_seconds, give_up)
    late.start()
    welcomed = False
    node: ClientNode | None = None
    run_id = ""
    try:
        for piece in replies:
            try:
                message = chunks.add(piece)
            except protocol.ChunkError as error:
                raise UserError(f"the server sent {error}") from None
            if message is None:
                continue
            if message.version != protocol.PROTOCOL_VERSION:
                raise UserError(
                    f"the server speaks protocol {message.version}, this client {protocol.PROTOCOL_VERSION}"
                )
            if message.kind == protocol.BYE:
                raise _Finished
            if message.kind == protocol.WELCOME:
                late.cancel()
                welcomed, run_id = True, message.run_id
                welcome = codec.decode(bytes(message.payload))
                chunk_bytes = chunks.chunk_bytes = _chunk_bytes(welcome.get("chunk_bytes"))
                _heartbeats(outgoing, run_id, float(welcome["heartbeat"]), stop)
                node = _build_node(settings, welcome["config"])
                report = codec.encode(data_report(node, settings.data))
                outgoing.put(protocol.envelope(protocol.REPORT, run_id, payload=report))
                log(settings.client_id, f"joined run {run_id}; reported {node.num_samples} samples")
            elif message.kind == protocol.CALL and node is not None and message.run_id == run_id:
                outgoing.put(_answer(node, message, run_id))
    except grpc.RpcError as error:
        if silent.is_set() and not welcomed:
            raise _Silent(f"no WELCOME within welcome_seconds={settings.welcome_seconds:g} s") from None
        if not welcomed or error.code() == grpc.StatusCode.PERMISSION_DENIED:
            raise
        log(settings.client_id, f"connection lost ({error.code()}); reconnecting")
    finally:
        late.cancel()
        stop.set()
        outgoing.put(None)
    return welcomed


def _chunk_bytes(value: Any) -> int:
    """The server's chunk size from its WELCOME, checked: a whole number of bytes gRPC carries."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= protocol.MAX_CHUNK_KIB * 1024:
        raise UserError(f"the server's WELCOME gives chunk_bytes={value!r}, not 1 to {protocol.MAX_CHUNK_KIB * 1024}")
    return value


def _heartbeats(outgoing: queue.Queue, run_id: str, every: float, stop: threading.Event) -> None:
    def beat() -> None:
        while not stop.wait(every):
            outgoing.put(protocol.envelope(protocol.HEARTBEAT, run_id))

    threading.Thread(target=beat, daemon=True).start()


def _build_node(settings: ClientSettings, config: dict[str, Any]) -> ClientNode:
    from splitlab.build import client_node

    own = {
        "device": settings.device,
        "data": settings.data,
        **({"data_dir": settings.data_dir} if settings.data_dir else {}),
    }
    node = client_node({**config, **own}, settings.client_id)
    if node.blueprint.defense.random:  # its own noise key, which the server never gets (splitlab.privacy.keys)
        noise_key = config.get("noise_key")
        _, _, private_key = read_pair(settings.certs, client_name(settings.client_id))
        secret = keys.from_setting(noise_key) if noise_key is not None else keys.from_private_key(private_key, config)
        node.blueprint.noise_secret = secret
    return node


def _answer(node: ClientNode, message: Any, run_id: str) -> Any:
    """The RESULT of a CALL, or an ERROR saying in one line why there is none."""
    try:
        if not hasattr(getattr(type(node), message.verb, None), "__verb__"):
            raise Refused(f"{message.verb!r} is not a verb of {type(node).__name__}")
        method = getattr(node, message.verb)
        request = codec.decode(bytes(message.payload), node.blueprint.device)
        if not isinstance(request, dict) or set(request) != {"args", "kwargs"}:
            raise Refused("a call holds exactly args and kwargs")
        check_finite(request)
        result = method(*request["args"], **request["kwargs"])
        return protocol.envelope(protocol.RESULT, run_id, seq=message.seq, payload=codec.encode(result))
    except Exception as error:  # the server drops this client and it starts afresh
        line = (str(error).splitlines() or [type(error).__name__])[0][:300]
        return protocol.envelope(protocol.ERROR, run_id, seq=message.seq, error=f"{type(error).__name__}: {line}")
