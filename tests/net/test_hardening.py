"""No client can stall the server, a client whose host vanished comes back, the operator revokes
and audits: floods of streams without HELLO (an insider) and of connections without TLS (an
outsider), a client stopped dead (SIGSTOP) replaced by a new connection with its key, a client
revoked while it trains, and how long an absent client is waited for. A `splitlab server` or
`splitlab client` process only where one is stopped or its exit and words are what is checked;
the other clients run `splitlab client`'s code in threads of this process."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator

import grpc
import pytest
from processes import ClientThread, ServerThread, credentials

from helpers import held_plugin, quick
from splitlab.errors import UserError
from splitlab.net import protocol
from splitlab.net.audit import AuditLog
from splitlab.net.certs import make_certs
from splitlab.net.server import Hub, ServerSettings


def _silent_streams(address: str, creds: grpc.ChannelCredentials, count: int) -> list[grpc.RpcError | None]:
    """`count` streams that never say HELLO; how each ended (None: it did not end by itself)."""
    channel = grpc.secure_channel(address, creds)
    never = threading.Event()

    def nothing() -> Iterator[object]:
        never.wait()
        yield from ()

    connect = channel.stream_stream(protocol.METHOD, protocol.Envelope.SerializeToString, protocol.Envelope.FromString)
    ends: list[grpc.RpcError | None] = [None] * count

    def hold(i: int) -> None:
        try:
            next(connect(nothing()))
        except grpc.RpcError as error:
            ends[i] = error

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    never.set()
    channel.close()
    return ends


def test_floods_of_silent_streams_and_raw_connections_leave_honest_clients_admitted(tmp_path):
    config = quick(clients=2, rounds=2, train_subset=100, test_subset=50, out=str(tmp_path / "run"))
    make_certs(tmp_path / "certs", 2, [])
    server = ServerThread(config, tmp_path / "certs", hello_timeout=1, join_timeout=60, rejoin_wait=60)
    host, port = server.address.split(":")
    outsiders = [socket.create_connection((host, int(port))) for _ in range(40)]  # no TLS, never a byte
    insider = _silent_streams(server.address, credentials(tmp_path / "certs", "client-1"), 24)
    codes = [error.code() for error in insider]  # type: ignore[union-attr]
    exhausted, late = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED), codes.count(grpc.StatusCode.CANCELLED)
    assert exhausted + late == 24 and exhausted >= 16  # 2 streams per certificate at once, each ended at 1 s
    honest = [server.client(0), server.client(1)]
    assert isinstance(server.wait(), dict) and honest == [[0], [0]], (server.ended, server.lines)
    for sock in outsiders:
        sock.close()
    lines = server.lines
    assert sum("no HELLO within hello_timeout" in line for line in lines) == late
    capped = sum("client-1 already holds streams_per_client=2 streams" in line for line in lines)
    assert 1 <= capped <= exhausted  # the others: past the pool's 12 streams, refused by gRPC itself


def test_a_stopped_client_is_replaced_by_a_new_connection_with_its_key(tmp_path, servers):
    config = quick(clients=2, rounds=3, train_subset=100, test_subset=50, out=str(tmp_path / "run"))
    make_certs(tmp_path / "certs", 2, [])
    # replaced after 2 heartbeats without a word (6 s), before a call drops it for silence (3 missed)
    server = servers(config, join_timeout=60, rejoin_wait=60, heartbeat=3)
    first, vanished = ClientThread(server, 0), server.client(1)
    server.wait_for_log("client 1 holds")
    vanished.send_signal(signal.SIGSTOP)  # its host is gone: no FIN, no heartbeat, no answer
    try:
        assert server.client_in_process(1) == 0  # until the run ends
        assert server.process.wait() == 0 and first.wait() == 0
    finally:
        vanished.kill()
        vanished.wait()
    lines = server.lines()
    assert sum("dropped client 1: replaced by a newer connection" in line for line in lines) == 1
    assert not any("already connected" in line for line in lines)


def test_a_revoked_client_is_dropped_and_refused_and_every_event_audited(tmp_path, servers, monkeypatch):
    # the run waits before round 1 (a plugin's copy of sfl_v2) until the revocation (re-read every
    # second), the revoked process's exit and the refusal of its key when it comes back are seen
    held, hold = held_plugin(tmp_path, "sfl_v2")
    monkeypatch.chdir(tmp_path)  # the plugin, for the processes started here
    monkeypatch.syspath_prepend(str(tmp_path))  # and for the client in this process
    config = quick(clients=2, rounds=2, train_subset=100, test_subset=50, **held)
    revoked = tmp_path / "revoked.txt"
    revoked.write_text("# nobody yet\n")
    make_certs(tmp_path / "certs", 2, [])
    server = servers({**config, "out": str(tmp_path / "run")}, revoked=revoked, join_timeout=60, rejoin_wait=0.5)
    staying = ClientThread(server, 0)
    leaving = server.client(1, stderr=subprocess.PIPE)
    server.wait_for_log("client 1 holds")
    revoked.write_text("client-1  # its laptop was stolen\n")
    assert leaving.wait() == 2
    assert "the server refused client 1: client 1 is revoked" in leaving.stderr.read()  # type: ignore[union-attr]
    with pytest.raises(UserError, match=r"the server refused client 1: the certificate of client-1 .* is revoked"):
        server.client_in_process(1)
    hold.unlink()  # round 1 and on, without client 1
    assert server.process.wait() == 0 and staying.wait() == 0
    audit = [json.loads(line) for line in (tmp_path / "run" / "connections.jsonl").read_text().splitlines()]
    events = [(row["event"], row["client"]) for row in audit]
    assert events.count(("connect", 1)) == 1 and events.count(("revocation", 1)) == 1
    refusal = [row for row in audit if row["event"] == "refusal"]
    assert len(refusal) == 1 and "revoked" in refusal[0]["reason"] and refusal[0]["subject"] == "CN=client-1"
    assert set(audit[0]) == {"time", "event", "peer", "subject", "serial", "fingerprint", "client", "verb", "reason"}


def test_join_timeout_waits_for_every_client_until_all_have_joined_then_rejoin_wait(tmp_path):
    """The join phase lasts until every client has reported once (at most join_timeout): until
    then an absent client (never came, or left) is waited for until it ends; after it, a client
    that left (trained, dropped, not needed any more) is waited for rejoin_wait only."""
    hub = Hub(ServerSettings(rejoin_wait=5), {"clients": 2}, AuditLog(tmp_path / "connections.jsonl"))
    hub._expected, hub._reported, hub._join_deadline = {0, 1}, {0}, 100.0
    assert hub._give_up_at(10.0) == 100.0  # client 1 has not joined yet: the phase goes on
    assert hub._give_up_at(98.0) == 103.0  # never less than rejoin_wait
    hub._reported.add(1)
    assert hub._give_up_at(10.0) == 15.0  # both joined once: a client that left gets rejoin_wait
