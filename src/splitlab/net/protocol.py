"""The wire protocol: one protobuf message, `Envelope`, on a bidirectional gRPC stream per client.

The client opens the stream (`Node/Connect`) and says HELLO with its id; the server, having
checked the id against the client's certificate, answers WELCOME with the run's config; the
client builds its node and REPORTs what data it holds (how many samples of each class, their
shape), which the server checks against the run before it uses the client; from then on the
server sends CALLs (a verb and its arguments) and the client answers each with a
RESULT (or an ERROR) of the same sequence number, and a HEARTBEAT every few seconds; BYE ends
the run. Arguments and results are splitlab.codec messages (safetensors plus a strict JSON
skeleton): nothing on the wire is ever unpickled. The envelope is defined here, in code, so
there is no generated module to keep in step with the protobuf runtime; as a .proto file:

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
    }
    service Node { rpc Connect(stream Envelope) returns (stream Envelope); }
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

PROTOCOL_VERSION = 2  # 2: REPORT
METHOD = "/splitlab.net.Node/Connect"

INVALID, HELLO, WELCOME, CALL, RESULT, ERROR, HEARTBEAT, BYE, REPORT = range(9)  # INVALID: never sent (see Hub._parse)

_FIELDS = [
    ("version", descriptor_pb2.FieldDescriptorProto.TYPE_UINT32),
    ("run_id", descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
    ("seq", descriptor_pb2.FieldDescriptorProto.TYPE_UINT64),
    ("kind", descriptor_pb2.FieldDescriptorProto.TYPE_UINT32),
    ("verb", descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
    ("client_id", descriptor_pb2.FieldDescriptorProto.TYPE_INT64),
    ("payload", descriptor_pb2.FieldDescriptorProto.TYPE_BYTES),
    ("error", descriptor_pb2.FieldDescriptorProto.TYPE_STRING),
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


#: The largest max_message_mib: gRPC's message lengths are signed 32-bit, at most 2**31 - 1 bytes.
MAX_MESSAGE_MIB = (2**31 - 1) // 2**20


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel options both ends use: the message size limit, and keepalive pings so that a
    vanished peer is noticed even when no call is in flight."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
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
