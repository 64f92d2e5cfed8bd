"""Who counts as a client, and for how long a missing one holds the others, over real loopback
gRPC with mutual TLS (the server and its clients in threads of this process): a connection cut
short in its handshake is no client and no dropout, two connections with one certificate leave
one session (the other refused, the run as if undisturbed), a client whose data is refused frees
its slot at once, one that never reports is left out with a line saying so."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from processes import Rogue, ServerThread, credentials
from safetensors.torch import load_file

from helpers import quick
from splitlab import codec
from splitlab.build import client_node
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.ledger import Ledger
from splitlab.net import protocol
from splitlab.net.audit import AuditLog
from splitlab.net.certs import make_certs
from splitlab.net.checks import OwnPartyReports, data_report
from splitlab.net.launch import _free_port
from splitlab.net.server import Hub, ServerSettings, client_config

#: the join phase as long as it is by default in spirit: a test would take this long if a missing
#: client held the others until its end
JOIN = dict(join_timeout=120, rejoin_wait=120, heartbeat=0.5)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    make_certs(folder, 2, [])
    return folder


@pytest.fixture
def waiting_for(monkeypatch) -> dict[int, threading.Event]:
    """An event per client id, set when the run first waits for that client (Hub.session)."""
    events = {k: threading.Event() for k in range(2)}
    original = Hub.session

    def session(self: Hub, client_id: int) -> Any:
        events[client_id].set()
        return original(self, client_id)

    monkeypatch.setattr(Hub, "session", session)
    return events


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def as_if_undisturbed(config: dict, out: Path, tmp_path: Path) -> None:
    """The networked run in `out` ended as `splitlab run` does: no dropout, the same weights and bytes."""
    run({**config, "out": str(tmp_path / "local")}, progress=False)
    net, local = load_file(out / "weights.safetensors"), load_file(tmp_path / "local" / "weights.safetensors")
    assert net.keys() == local.keys() and all(torch.equal(net[k], local[k]) for k in local)
    assert [row["dropped_clients"] for row in rows(out)] == [[]] * len(rows(out))
    local_rows = rows(tmp_path / "local")
    assert [r["comm_bytes_by_kind"] for r in rows(out)] == [r["comm_bytes_by_kind"] for r in local_rows]


def test_a_connection_cut_short_in_its_handshake_is_no_client_and_no_dropout(tmp_path, certs, waiting_for):
    """Client 1's certificate says HELLO, gets WELCOME and is gone before it reports, while the run
    waits for client 1: the run goes on waiting for client 1 (the join phase), which then joins."""
    config = quick(clients=2, rounds=2, train_subset=100, test_subset=50)
    out = tmp_path / "net"
    server = ServerThread({**config, "out": str(out)}, certs, **JOIN)
    cut_short = Rogue(server.address, credentials(certs, "client-1"), 1)
    assert next(cut_short.replies).kind == protocol.WELCOME
    first = server.client(0)
    waiting_for[1].wait()  # the run waits for client 1, whose only connection is the one cut short
    cut_short.replies.cancel()  # its stream ends at once (RST_STREAM), before any REPORT
    cut_short.close()
    server.wait_for_log("dropped client 1|client 1 left")
    second = server.client(1)
    assert isinstance(server.wait(), dict) and first == [0] and second == [0], (server.ended, server.lines)
    assert not any("left out" in line for line in server.lines)
    as_if_undisturbed(config, out, tmp_path)


def test_a_second_connection_with_a_connected_clients_certificate_is_refused(tmp_path, certs, waiting_for):
    """Two clients with client 0's certificate in a one-client run: the second is refused while
    the first is heard from (its heartbeats), the first finishes undisturbed."""
    config = quick(clients=1, rounds=2, train_subset=100, test_subset=50)
    out = tmp_path / "net"
    server = ServerThread({**config, "out": str(out)}, certs, **JOIN)
    first = server.client(0)
    server.wait_for_log("client 0 connected")
    second = server.client(0)
    assert isinstance(server.wait(), dict), (server.ended, server.lines)
    assert first == [0] and isinstance(second[0], UserError), second
    assert "client 0 is already connected" in str(second[0]) and "one connection per client" in str(second[0])
    as_if_undisturbed(config, out, tmp_path)


def test_a_connection_gone_silent_is_replaced_and_the_run_waits_for_the_new_one(tmp_path, certs, waiting_for):
    """Client 0's certificate says HELLO and is never heard from again (its host vanished) while
    the run waits for client 0: a new connection with the certificate replaces it (the silent one
    is told so) and the run goes on with the new one, as if undisturbed."""
    config = quick(clients=1, rounds=2, train_subset=100, test_subset=50)
    out = tmp_path / "net"
    server = ServerThread({**config, "out": str(out)}, certs, **JOIN)
    vanished = Rogue(server.address, credentials(certs, "client-0"), 0)
    assert next(vanished.replies).kind == protocol.WELCOME
    waiting_for[0].wait()
    back = server.client(0)
    with pytest.raises(grpc.RpcError) as replaced:
        next(vanished.replies)
    assert replaced.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "replaced by a newer connection" in replaced.value.details()
    vanished.close()
    assert isinstance(server.wait(), dict) and back == [0], (server.ended, server.lines)
    as_if_undisturbed(config, out, tmp_path)


def report_of(rogue: Rogue, **change: Any) -> None:
    """After WELCOME, the REPORT the node of the run's client `rogue.client_id` would send, with `change`."""
    welcome = next(rogue.replies)
    assert welcome.kind == protocol.WELCOME
    config = codec.decode(bytes(welcome.payload))["config"]
    report = {**data_report(client_node(config, rogue.client_id), "partition"), **change}
    rogue.outgoing.put(protocol.envelope(protocol.REPORT, welcome.run_id, payload=codec.encode(report)))


def test_a_client_whose_data_is_refused_frees_its_slot_at_once(tmp_path, certs):
    """Client 1 reports other class counts than its partition's: it is refused (and stops), the
    join phase ends as soon as client 0 is in, and each round leaves client 1 out at once, saying
    why, instead of holding client 0 until join_timeout."""
    config = quick(clients=2, rounds=2, train_subset=100, test_subset=50)
    out = tmp_path / "net"
    server = ServerThread({**config, "out": str(out)}, certs, **JOIN)
    wrong = Rogue(server.address, credentials(certs, "client-1"), 1)
    report_of(wrong, class_counts=[50] + [0] * 9)
    with pytest.raises(grpc.RpcError) as refused:
        next(wrong.replies)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "its data: it holds" in refused.value.details()
    wrong.close()
    first = server.client(0)
    assert isinstance(server.wait(), dict) and first == [0], (server.ended, server.lines)
    assert [row["dropped_clients"] for row in rows(out)] == [[[1, 1]], [[2, 1]]]
    left_out = [line for line in server.lines if "client 1 is left out" in line]
    assert left_out and all("it was refused (its data: it holds 50 samples" in line for line in left_out)


def test_a_client_that_never_reports_is_left_out_after_the_wait_saying_so(tmp_path, certs):
    config = quick(clients=2, rounds=2, train_subset=100, test_subset=50)
    out = tmp_path / "net"
    server = ServerThread({**config, "out": str(out)}, certs, join_timeout=4, call_timeout=2, rejoin_wait=0.5)
    silent = Rogue(server.address, credentials(certs, "client-1"), 1)
    assert next(silent.replies).kind == protocol.WELCOME  # and nothing from it ever after
    first = server.client(0)
    assert isinstance(server.wait(), dict) and first == [0], (server.ended, server.lines)
    silent.close()
    assert [row["dropped_clients"] for row in rows(out)] == [[[1, 1]], [[2, 1]]]
    left_out = [line for line in server.lines if "client 1 is left out" in line]
    assert left_out  # a line each time the run needs it (each round)
    said = r"connected [\d.]+ s ago but has not reported its data, call_timeout=2 s"
    assert all(re.search(said, line) for line in left_out)


class Entered(threading.Event):
    """A session's `heard`, saying when a newer connection starts waiting on it (Hub._admit)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waited.set()
        return super().wait(timeout)


def test_a_connection_that_waits_to_be_admitted_while_the_server_closes_is_refused(tmp_path, certs):
    """A second connection with client 0's certificate waits to see whether the first is heard
    from; the server closes meanwhile (its run is over): it is refused, as every connection once
    the server is shutting down, not admitted as a session nobody ever tells BYE (its client would
    then wait on an open stream until gRPC aborted it, and retry for retry_seconds)."""
    settings = ServerSettings(listen=f"127.0.0.1:{_free_port()}", certs=certs, heartbeat=30)
    raw = {**quick(clients=2), "out": str(tmp_path / "run")}
    hub = Hub(settings, client_config(raw), AuditLog(tmp_path / "connections.jsonl"))
    hub.start()
    hub.expect({0: None, 1: None}, Ledger(), OwnPartyReports())
    first = Rogue(settings.listen, credentials(certs, "client-0"), 0)
    assert next(first.replies).kind == protocol.WELCOME
    heard = hub._sessions[0].heard = Entered()
    replies: list[Any] = []

    def second() -> None:
        rogue = Rogue(settings.listen, credentials(certs, "client-0"), 0)
        replies.append(rogue.first_reply())
        rogue.close()

    waiting = threading.Thread(target=second)
    waiting.start()
    heard.waited.wait()
    hub.close()
    waiting.join()
    assert next(first.replies).kind == protocol.BYE
    first.close()
    (refused,) = replies
    assert isinstance(refused, grpc.RpcError) and refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.details() == "the server is shutting down"
