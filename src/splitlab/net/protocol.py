"""The wire protocol: one protobuf message, `Envelope`, on a bidirectional gRPC stream per client.

The client opens the stream (`Node/Connect`) and says HELLO with its id; the server, having
checked the id against the client's certificate, answers WELCOME with the run's config; the
client builds its node and REPORTs what data it holds (how many samples of each class, their
shape), which the server checks against the run before it uses the client; from then on the
server sends CALLs (a verb and its arguments) and the client answers each with a
RESULT (or an ERROR) of the same sequence number, and a HEARTBEAT every few seconds; BYE ends
the run. Arguments and results are splitlab.codec messages (safetensors plus a strict JSON
skeleton): nothing on the wire is ever unpickled. A payload larger than the server's chunk size
(`chunk_kib`, sent in WELCOME) goes as several envelopes of the same kind and sequence number,
numbered `chunk` 0 .. `chunks` - 1 and each announcing the `total` size, which the receiver
joins again (`Assembler`): so a message may exceed gRPC's 2 GiB limit on one message. The
envelope is defined here, in code, so there is no generated module to keep in step with the
protobuf runtime; as a .proto file:

    syntax = "proto3";
    package splitlab.net;
    message Envelope {
      uint32 version = 1;   // PROTOCOL_VERSION
      string run_id = 2;    // the server's id for this run (every message after WELCOME)
      uint64 seq = 3;       // a CALL's number; its RESULT or ERROR carries the same
      uint32 kind = 4;      // HELLO, WELCOME, CALL, RESULT, ERROR, HEARTBEAT, BYE, REPORT
      string verb = 5;      // CALL: the role method
      int64 client_id = 6;  // HELLO: who the client says it is
      bytes payload = 7;    // WELCOME: the config; CALL: the arguments; RESULT: the result; REPORT: the data
      string error = 8;     // ERROR: what went wrong, one line
      uint32 chunk = 9;     // a chunked payload: this piece's index, from 0
      uint32 chunks = 10;   // a chunked payload: how many pieces (0: not chunked)
      uint64 total = 11;    // a chunked payload: its size in bytes
    }
    service Node { rpc Connect(stream Envelope) returns (stream Envelope); }
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTOCOL_VERSION = 3  # 2: REPORT; 3: chunked payloads
METHOD = "/splitlab.net.Node/Connect"

INVALID, HELLO, WELCOME, CALL, RESULT, ERROR, HEARTBEAT, BYE, REPORT = range(9)  # INVALID: never sent (see Hub._parse)
KINDS = ("INVALID", "HELLO", "WELCOME", "CALL", "RESULT", "ERROR", "HEARTBEAT", "BYE", "REPORT")

_FIELDS = [
    ("version", descriptor_pb2.FieldDescriptorProto.TYPE_UINT32),
    ("run_id", descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
    ("seq", descriptor_pb2.FieldDescriptorProto.TYPE_UINT64),
    ("kind", descriptor_pb2.FieldDescriptorProto.TYPE_UINT32),
    ("verb", descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
    ("client_id", descriptor_pb2.FieldDescriptorProto.TYPE_INT64),
    ("payload", descriptor_pb2.FieldDescriptorProto.TYPE_BYTES),
    ("error", descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
    ("chunk", descriptor_pb2.FieldDescriptorProto.TYPE_UINT32),
    ("chunks", descriptor_pb2.FieldDescriptorProto.TYPE_UINT32),
    ("total", descriptor_pb2.FieldDescriptorProto.TYPE_UINT64),
]


def _envelope_class() -> Any:
    file = descriptor_pb2.FileDescriptorProto(name="splitlab/net.proto", package="splitlab.net", syntax="proto3")
    message = file.message_type.add(name="Envelope")
    for number, (name, kind) in enumerate(_FIELDS, start=1):
        message.field.add(name=name, number=number, type=kind, label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("splitlab.net.Envelope"))


Envelope = _envelope_class()


def envelope(kind: int, run_id: str = "", **fields: Any) -> Any:
    return Envelope(version=PROTOCOL_VERSION, kind=kind, run_id=run_id, **fields)


#: The largest max_message_mib (1 TiB): larger payloads than gRPC carries in one message go in chunks.
MAX_MESSAGE_MIB = 1 << 20
#: gRPC's message lengths are signed 32-bit: one envelope is at most this many bytes.
GRPC_MAX_BYTES = 2**31 - 1
#: The largest chunk_kib (1 GiB): a chunk and its envelope's other fields fit in one gRPC message.
MAX_CHUNK_KIB = 1 << 20


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel options both ends use: the message size limit (gRPC's at most), and keepalive
    pings so that a vanished peer is noticed even when no call is in flight."""
    limit = min(max_message_bytes, GRPC_MAX_BYTES)
    return [
        ("grpc.max_send_message_length", limit),
        ("grpc.max_receive_message_length", limit),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def host_port(address: str, key: str) -> str:
    """`address` if it is HOST:PORT with a port in 1..65535 ([::1]:PORT for IPv6); else ValueError
    naming `key` (gRPC would dial port 443 without one, and wrap a port past 65535)."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{key}={address!r} is not HOST:PORT with a port from 1 to 65535")
    return address


def chunked(message: Any, chunk_bytes: int) -> Iterator[Any]:
    """`message` as it goes on the wire: itself if its payload fits in `chunk_bytes`, else one
    envelope per `chunk_bytes` of it (the last one shorter), made one at a time as they are sent."""
    payload = message.payload
    if len(payload) <= chunk_bytes:
        yield message
        return
    count = -(-len(payload) // chunk_bytes)
    header = {name: getattr(message, name) for name in _HEADER}
    for index in range(count):
        piece = payload[index * chunk_bytes : (index + 1) * chunk_bytes]
        yield Envelope(payload=piece, chunk=index, chunks=count, total=len(payload), **header)


class ChunkError(ValueError):
    """Chunks that do not make one message: one line saying why."""


class Assembler:
    """Joins the chunks of one peer's messages, in the order they are sent, into whole envelopes.

    Refuses (ChunkError) a payload over `chunk_bytes` in one envelope (the sender did not chunk
    it), a message announced larger than `limit` bytes, a chunk out of order or given twice,
    chunks that do not match the first (kind, sequence number, verb, count, size), more bytes
    than announced or fewer by the last chunk, an empty chunk, and any other message between the
    chunks of one (a sender writes a message's chunks one after the other)."""

    def __init__(self, limit: int, limit_name: str, chunk_bytes: int = GRPC_MAX_BYTES) -> None:
        self.limit, self.limit_name, self.chunk_bytes = limit, limit_name, chunk_bytes
        self._first: Any = None
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, message: Any) -> Any:
        """The whole message once `message` completes one (a message not chunked at once); else None."""
        first = self._first
        if len(message.payload) > self.chunk_bytes:
            size = len(message.payload)
            raise ChunkError(
                f"a {_kind(message)} of {size} bytes in one envelope, over the chunk size {self.chunk_bytes}"
            )
        if message.chunks == 0:
            if first is not None:
                raise ChunkError(f"a {_kind(message)} inside the chunks of {_name(first)}")
            if message.chunk or message.total:
                raise ChunkError(f"chunk {message.chunk} of {message.total} bytes, without a count of chunks")
            return message
        if first is None:
            if message.chunk != 0:
                raise ChunkError(f"chunk {message.chunk} of {_name(message)} before its chunk 0")
            if message.total > self.limit:
                raise ChunkError(f"{_name(message)} announces {message.total} bytes, over {self.limit_name}")
            if not 2 <= message.chunks <= message.total:
                raise ChunkError(f"{_name(message)} announces {message.total} bytes in {message.chunks} chunks")
            self._first = first = message
        elif _header(message) != _header(first):
            raise ChunkError(f"chunk {message.chunk} ({_name(message)}) does not match chunk 0 ({_name(first)})")
        expected = len(self._parts)
        if message.chunk < expected:
            raise ChunkError(f"chunk {message.chunk} of {_name(first)} again")
        if message.chunk > expected:
            raise ChunkError(f"chunk {message.chunk} of {_name(first)} while chunk {expected} was due")
        if not message.payload:
            raise ChunkError(f"chunk {message.chunk} of {_name(first)} is empty")
        self._size += len(message.payload)
        if self._size > first.total:
            raise ChunkError(f"chunk {message.chunk} of {_name(first)} goes past the {first.total} bytes announced")
        self._parts.append(bytes(message.payload))
        if message.chunk < first.chunks - 1:
            return None
        if self._size != first.total:
            raise ChunkError(f"{_name(first)} ends at {self._size} bytes, {first.total} announced")
        whole = Envelope(payload=b"".join(self._parts), **{name: getattr(first, name) for name in _HEADER})
        self._first, self._parts, self._size = None, [], 0
        return whole


_HEADER = ("version", "kind", "run_id", "seq", "verb", "client_id", "error")


def _header(message: Any) -> tuple[Any, ...]:
    return (*(getattr(message, name) for name in _HEADER), message.chunks, message.total)


def _kind(message: Any) -> str:
    return KINDS[message.kind] if message.kind < len(KINDS) else f"message of kind {message.kind}"


def _name(message: Any) -> str:
    return f"{_kind(message)} {message.seq} in {message.chunks} chunks"
