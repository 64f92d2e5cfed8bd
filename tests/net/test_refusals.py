"""What the server refuses, and that it stays up: each refusal is one log line, and the run goes on
(the server and its honest clients in threads of this process: real gRPC, mutual TLS)."""

from __future__ import annotations

import json
import os
import re
import socket
import threading

import grpc
import pytest
import torch
from processes import NONE, Rogue, ServerThread, credentials

from helpers import quick
from splitlab import codec
from splitlab.engine import build
from splitlab.net.certs import make_certs
from splitlab.net.checks import Checks, Refused
from splitlab.roles import ClientNode
from splitlab.transport import VerbSpec


def test_server_refuses_bad_peers_and_messages_and_goes_on(tmp_path):
    config = quick(clients=2, rounds=2, train_subset=100, test_subset=50, out=str(tmp_path / "run"))
    certs = tmp_path / "certs"
    make_certs(certs, 2, [])
    make_certs(tmp_path / "other", 1, [])  # another CA, with its own client-0
    server = ServerThread(config, certs, max_message_mib=1, rejoin_wait=60, join_timeout=60)

    with socket.create_connection(server.address.split(":")) as raw:  # not TLS at all
        raw.sendall(os.urandom(512))
    refused = {
        "no client certificate": Rogue(server.address, credentials(certs, None), 0),
        "another CA": Rogue(server.address, credentials(certs, "client-0", own=tmp_path / "other"), 0),
        "the server's certificate": Rogue(server.address, credentials(certs, "server"), 0),  # not for clients
        "wrong id": Rogue(server.address, credentials(certs, "client-1"), 0),
        "oversized": Rogue(server.address, credentials(certs, "client-0"), 0, hello_payload=bytes((1 << 20) + 1000)),
    }
    for name, rogue in refused.items():
        error = rogue.first_reply()
        assert isinstance(error, grpc.RpcError), name
        rogue.close()
    # An authenticated client 0 that sends smashed data of the wrong shape.
    rogue = Rogue(server.address, credentials(certs, "client-0"), 0)
    assert rogue.first_reply().kind == 2  # WELCOME
    bad = codec.encode({"smashed": torch.zeros(32, 7), "labels": torch.zeros(32, dtype=torch.int64)})
    answering = threading.Thread(target=rogue.serve, args=(lambda call: bad if call.verb == "forward" else NONE,))
    answering.start()
    honest = server.client(1)
    server.wait_for_log("refused the result of forward")
    answering.join()
    rogue.close()
    back = server.client(0)  # the real client 0 joins in round 2
    assert isinstance(server.wait(), dict) and honest == [0] and back == [0], (server.ended, server.lines)

    refusals = [line for line in server.lines if line.startswith("splitlab server:") and "refused" in line]
    expected = [
        "client_id=0, but its certificate is 'client-1''s",
        "over max_message_mib=1",
        "smashed is torch.float32 (32, 7), expected torch.float32 (B, ",
    ]
    assert len(refusals) == len(expected), "\n".join(refusals)  # TLS failures are gRPC's: not logged
    for text in expected:
        assert sum(text in line for line in refusals) == 1, text
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["dropped_clients"] for row in rows] == [[[1, 0]], []]
    audit = [json.loads(line) for line in (tmp_path / "run" / "connections.jsonl").read_text().splitlines()]
    events = [(row["event"], row["client"], row["verb"]) for row in audit]
    assert events.count(("connect", 0, "")) == 2 and events.count(("connect", 1, "")) == 1
    assert ("refusal", 0, "forward") in events  # its refusal is its drop
    assert sorted(row["reason"] for row in audit if row["event"] == "refusal" and row["verb"] == "") == [
        "a message of 1049584 bytes, over max_message_mib=1",
        "client_id=0, but its certificate is 'client-1''s",
    ]
    client_0 = [row for row in audit if row["client"] == 0 and row["event"] == "connect"]
    assert all(row["subject"] == "CN=client-0" and len(row["fingerprint"]) == 64 for row in client_0)
    assert len({row["serial"] for row in client_0}) == 1


@pytest.fixture(scope="module")
def checks() -> Checks:
    return Checks(build(quick(clients=2, train_subset=100)).blueprint)


FORWARD = ClientNode.forward.__verb__
UPLOAD = ClientNode.upload.__verb__
LOCAL_STEP = ClientNode.local_step.__verb__
STATE = ClientNode.state_dict.__verb__
LABELS = torch.zeros(4, dtype=torch.int64)


def _state(**optimizer: object) -> dict:
    node = build(quick(clients=2, train_subset=100)).roles.clients[0]
    node.begin_round(0)
    node.forward(0)
    node.backward(0, torch.zeros(1, 200))
    state = node.state_dict()
    state["optimizers"]["client_model"].update(optimizer)
    return state


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
        (
            "forward",
            FORWARD,
            (0,),
            {"smashed": torch.zeros(4, 200, dtype=torch.float64), "labels": LABELS},
            "smashed is torch.float64",
        ),
        (
            "forward",
            FORWARD,
            (0,),
            {"smashed": torch.full((4, 200), float("nan")), "labels": LABELS},
            "NaN or infinite",
        ),
        ("forward", FORWARD, (0,), {"smashed": torch.zeros(33, 200), "labels": LABELS}, "33 samples"),
        ("forward", FORWARD, (0,), {"smashed": torch.zeros(2, 200), "labels": torch.tensor([0, 99])}, "labels outside"),
        (
            "forward",
            FORWARD,
            (0,),
            {"smashed": torch.zeros(1, 200), "labels": torch.tensor(3)},
            "labels are torch.int64 ()",
        ),
        (
            "forward",
            FORWARD,
            (0,),
            {"smashed": torch.zeros(2, 200), "labels": torch.tensor([0, -100])},
            "labels outside",
        ),
        ("forward", FORWARD, (0,), {"smashed": torch.zeros(4, 200)}, "forward returns exactly ['labels', 'smashed']"),
        ("forward", FORWARD, (0,), {}, "the result holds []"),
        (
            "forward",
            FORWARD,
            (0,),
            {"smashed": torch.zeros(4, 200), "labels": LABELS, "x": torch.zeros(9)},
            "holds ['labels', 'smashed', 'x']",
        ),
        (
            "forward",
            FORWARD,
            (0,),
            {
                "smashed": {
                    "values": torch.zeros(4, 1),
                    "indices": torch.zeros(4, 1, dtype=torch.int32),
                    "shape": torch.tensor([4, 1 << 30], dtype=torch.int32),
                },
                "labels": LABELS,
            },
            "smashed claims the shape [4, 1073741824]",
        ),
        (
            "local_step",
            LOCAL_STEP,
            (),
            {"loss": torch.zeros(2)},
            "loss is torch.float32 (2,), expected a torch.float32 scalar",
        ),
        ("local_step", LOCAL_STEP, (), {}, "local_step returns exactly ['loss']"),
        ("upload", UPLOAD, ("client_model",), {"0.weight": torch.zeros(1)}, "client_model holds ['0.weight']"),
        (
            "end_round",
            VerbSpec(),
            (),
            {"sneaked": torch.zeros(3)},
            "end_round returns nothing, but the result is a dict",
        ),
        (
            "state_dict",
            STATE,
            (),
            _state(state={0: {"momentum_buffer": torch.zeros(3)}}),
            "optimizer state for parameter 0 holds ['momentum_buffer']",
        ),
        (
            "state_dict",
            STATE,
            (),
            _state(state={1: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}}),
            "optimizer state 1.exp_avg is torch.float32 (3,), expected torch.float32 (200,)",
        ),
        ("state_dict", STATE, (), _state(param_groups=[]), "optimizer has 0 param groups"),
        ("snapshot", ClientNode.snapshot.__verb__, (7,), {}, "snapshot's result has no check"),
    ],
)
def test_checks_refuse_results_unlike_the_protocol(checks, verb, spec, args, result, message):
    with pytest.raises(Refused, match=re.escape(message)):
        checks.result(verb, spec, args, result)


def test_checks_accept_what_a_client_node_sends(checks):
    node = build(quick(clients=2, train_subset=100)).roles.clients[0]
    node.begin_round(0)
    checks.result("forward", FORWARD, (0,), node.forward(0))
    checks.result("upload", UPLOAD, ("client_model",), node.upload("client_model"))
    checks.result("state_dict", ClientNode.state_dict.__verb__, (), node.state_dict())


def test_checks_take_the_runs_precision_and_refuse_other_dtypes():
    """precision=bf16: smashed data crosses as bfloat16 and the loss is float32; a float32 smashed
    batch (or a bfloat16 one in an fp32 run) is refused, and a step of grad_accum micro-batches fits."""
    config = quick(clients=2, train_subset=100, precision="bf16", batch_size=4, grad_accum=2)
    experiment = build(config)
    node, bf16 = experiment.roles.clients[0], Checks(experiment.blueprint)
    node.begin_round(0)
    sent = node.forward(0)
    assert sent["smashed"].dtype == torch.bfloat16 and len(sent["smashed"]) == 8
    bf16.result("forward", FORWARD, (0,), sent)
    bf16.result("local_step", LOCAL_STEP, (), node.local_step())
    with pytest.raises(Refused, match=re.escape("smashed is torch.float32 (8, 200), expected torch.bfloat16")):
        bf16.result("forward", FORWARD, (0,), {**sent, "smashed": sent["smashed"].float()})
    fp32 = Checks(build(quick(clients=2, train_subset=100)).blueprint)
    with pytest.raises(Refused, match=re.escape("smashed is torch.bfloat16 (8, 200), expected torch.float32")):
        fp32.result("forward", FORWARD, (0,), sent)


def test_checks_take_fp16_and_a_clients_loss_scale():
    """precision=fp16: float16 smashed data, and a client's state holds its loss scale (scale > 0,
    a whole count of finite steps), which a state without it, or with a bad one, is refused for."""
    experiment = build(quick(clients=2, train_subset=100, precision="fp16"))
    node, fp16 = experiment.roles.clients[0], Checks(experiment.blueprint)
    node.begin_round(0)
    sent = node.forward(0)
    assert sent["smashed"].dtype == torch.float16
    fp16.result("forward", FORWARD, (0,), sent)
    state = node.state_dict()
    verb = ClientNode.state_dict.__verb__
    fp16.result("state_dict", verb, (), state)
    with pytest.raises(Refused, match="must hold exactly 'loss_scale', 'models', 'optimizers'"):
        fp16.result("state_dict", verb, (), {k: v for k, v in state.items() if k != "loss_scale"})
    for bad in (torch.tensor([0.0, 1.0], dtype=torch.float64), torch.tensor([2.0, 0.5], dtype=torch.float64)):
        with pytest.raises(Refused, match="loss_scale holds"):
            fp16.result("state_dict", verb, (), {**state, "loss_scale": bad})


def test_checks_take_a_u_shaped_fp16_tail_gradient_with_its_scale_and_refuse_a_bad_one():
    from splitlab.u_shaped import UShapedClient

    experiment = build(quick(clients=2, train_subset=100, precision="fp16", cut="1,2"))
    node, server, checks = experiment.roles.clients[0], experiment.roles.server, Checks(experiment.blueprint)
    node.begin_round(0)
    output = server.forward_middle(node.forward(0)["smashed"])
    sent, verb = node.tail_step(0, output), UShapedClient.tail_step.__verb__
    checks.result("tail_step", verb, (0, output), sent)
    scaled = sent["tail_grad"]
    for bad, why in (
        ({**scaled, "scale": -scaled["scale"]}, "scale must be finite and not negative"),
        ({**scaled, "grad": scaled["grad"].float()}, "tail_grad is torch.float32"),
        (scaled["grad"], "must come as its scaled value and its scale"),
    ):
        with pytest.raises(Refused, match=why):
            checks.result("tail_step", verb, (0, output), {**sent, "tail_grad": bad})
