"""What the server refuses, and that it stays up: each refusal is one log line, and the run goes on."""

from __future__ import annotations

import json
import os
import socket
import threading

import grpc
import pytest
import torch
from processes import NONE, Rogue, credentials

from helpers import quick
from splitlab import codec
from splitlab.engine import build
from splitlab.net.certs import make_certs
from splitlab.net.checks import Checks, Refused
from splitlab.roles import ClientNode
from splitlab.transport import KEYED, VerbSpec


def test_server_refuses_bad_peers_and_messages_and_goes_on(tmp_path, servers):
    config = quick(clients=2, rounds=2, train_subset=100, test_subset=50, out=str(tmp_path / "run"))
    make_certs(tmp_path / "certs", 2, [])
    make_certs(tmp_path / "other", 1, [])  # another CA, with its own client-0
    server = servers(config, max_message_mib=1, rejoin_wait=60, join_timeout=60)
    certs = tmp_path / "certs"

    with socket.create_connection(server.address.split(":")) as raw:  # not TLS at all
        raw.sendall(os.urandom(512))
    refused = {
        "no client certificate": Rogue(server.address, credentials(certs, None), 0),
        "another CA": Rogue(server.address, credentials(certs, "client-0", own=tmp_path / "other"), 0),
        "wrong id": Rogue(server.address, credentials(certs, "client-1"), 0),
        "oversized": Rogue(server.address, credentials(certs, "client-0"), 0, hello_payload=bytes((1 << 20) + 1000)),
    }
    for name, rogue in refused.items():
        error = rogue.first_reply()
        assert isinstance(error, grpc.RpcError), name
        rogue.close()
    server.wait_for_log("Handshake failed", 3)
    # An authenticated client 0 that sends smashed data of the wrong shape.
    rogue = Rogue(server.address, credentials(certs, "client-0"), 0)
    assert rogue.first_reply().kind == 2  # WELCOME
    duplicate = Rogue(server.address, credentials(certs, "client-0"), 0)
    assert duplicate.first_reply().code() == grpc.StatusCode.PERMISSION_DENIED
    duplicate.close()
    bad = codec.encode({"smashed": torch.zeros(32, 7), "labels": torch.zeros(32, dtype=torch.int64)})
    answering = threading.Thread(target=rogue.serve, args=(lambda verb: bad if verb == "forward" else NONE,))
    answering.start()
    honest = server.client(1)
    server.wait_for_log("refused the result of forward")
    answering.join()
    rogue.close()
    late = server.client(0)  # the real client 0 joins in round 2
    assert server.process.wait() == 0 and honest.wait() == 0 and late.wait() == 0

    lines = server.lines()
    refusals = [line for line in lines if "refused" in line or "Handshake failed" in line]
    expected = [
        "WRONG_VERSION_NUMBER",
        "PEER_DID_NOT_RETURN_A_CERTIFICATE",
        "certificate signature failure",  # the other CA did not sign it
        "client_id=0, but its certificate is 'client-1''s",
        "over max_message_mib=1",
        "client 0 is already connected",
        "smashed is torch.float32 (32, 7), expected torch.float32 (B, ",
    ]
    assert len(refusals) == len(expected), "\n".join(refusals)
    for text in expected:
        assert sum(text in line for line in refusals) == 1, text
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["dropped_clients"] for row in rows] == [[[1, 0]], []]


@pytest.fixture(scope="module")
def checks() -> Checks:
    return Checks(build(quick(clients=2, train_subset=100)).blueprint)


FORWARD = ClientNode.forward.__verb__
UPLOAD = ClientNode.upload.__verb__


@pytest.mark.parametrize(
    ("verb", "spec", "args", "result", "message"),
    [
        (
            "forward",
            FORWARD,
            (0,),
            {"smashed": torch.zeros(4, 200), "labels": torch.zeros(4)},
            "labels are torch.float32",
        ),
        ("forward", FORWARD, (0,), {"smashed": torch.zeros(4, 200, dtype=torch.float64)}, "smashed is torch.float64"),
        ("forward", FORWARD, (0,), {"smashed": torch.full((4, 200), float("nan"))}, "NaN or infinite"),
        ("forward", FORWARD, (0,), {"smashed": torch.zeros(33, 200)}, "33 samples"),
        ("forward", FORWARD, (0,), {"smashed": torch.zeros(2, 200), "labels": torch.tensor([0, 99])}, "labels outside"),
        ("local_step", VerbSpec(up=KEYED), (), {"loss": torch.zeros(2)}, "expected a floating-point scalar"),
        ("upload", UPLOAD, ("client_model",), {"0.weight": torch.zeros(1)}, "client_model holds ['0.weight']"),
        ("end_round", VerbSpec(), (), {"sneaked": torch.zeros(3)}, "returns no tensor"),
    ],
)
def test_checks_refuse_results_unlike_the_protocol(checks, verb, spec, args, result, message):
    with pytest.raises(Refused, match=message.replace("(", r"\(").replace("[", r"\[")):
        checks.result(verb, spec, args, result)


def test_checks_accept_what_a_client_node_sends(checks):
    node = build(quick(clients=2, train_subset=100)).roles.clients[0]
    node.begin_round(0)
    checks.result("forward", FORWARD, (0,), node.forward(0))
    checks.result("upload", UPLOAD, ("client_model",), node.upload("client_model"))
    checks.result("state_dict", ClientNode.state_dict.__verb__, (), node.state_dict())
