"""U-shaped split learning (`cut=A,B`): the client holds the head and the tail with the labels,
the server the stages between. The one-client and SFL-V1 reductions hold exactly, the ledger
counts four kinds and no labels, and every transport gives the same weights.

Bytes by hand (synthetic data, 300 samples over 3 clients of 100, the MLP 64-200-200-10 in
float32, cut=1,2): the client holds fc1 (13,000 parameters) and out (2,010): 60,040 bytes; per
sample, smashed data at cut 1 (200 floats, 800 bytes) up, the server's fc2 output (800 bytes)
down, its gradient (800 bytes) up, and the cut gradient at cut 1 (800 bytes) down.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import global_weights, max_abs_difference, quick, straight_and_resumed, train
from splitlab.cli import main
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.net.checks import Checks, Refused
from splitlab.resolve import resolve_config
from splitlab.roles import ClientNode

OPTIMIZERS = [dict(optimizer="sgd", lr=0.05), dict(optimizer="adam", lr=1e-3)]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o["optimizer"])
def test_u_shaped_sfl_v1_equals_fedavg(opt):
    config = quick(partition="dirichlet:0.5", **opt)
    fedavg = global_weights(train(2, algorithm="fedavg", **config))
    u_shaped = global_weights(train(2, algorithm="sfl_v1", cut="1,2", **config))
    assert max_abs_difference(u_shaped, fedavg) <= 1e-5
    assert max_abs_difference(fedavg, global_weights(train(0, algorithm="fedavg", **config))) > 1e-3


def test_u_shaped_cnn_sfl_v1_equals_fedavg():
    config = quick(model="cnn", train_subset=120, rounds=1, optimizer="adam")
    fedavg = global_weights(train(1, algorithm="fedavg", **config))
    assert max_abs_difference(global_weights(train(1, algorithm="sfl_v1", cut=[1, 3], **config)), fedavg) <= 1e-5


@pytest.mark.parametrize("algorithm,extra", [("sfl_v2", {}), ("sl", {})])
def test_u_shaped_one_client_equals_centralized(algorithm, extra):
    for opt, rounds in [(dict(optimizer="sgd", lr=0.05), 2), (dict(optimizer="adam"), 1)]:
        config = quick(clients=1, local_epochs=2, **opt)
        reference = global_weights(train(rounds, algorithm="centralized", **config))
        u_shaped = global_weights(train(rounds, algorithm=algorithm, cut="1,2", **extra, **config))
        assert max_abs_difference(u_shaped, reference) <= 1e-5, opt["optimizer"]


def test_u_shaped_sglr_with_one_client_equals_centralized():
    """SGLR's own lockstep, in two halves around the client's tail (one client: nothing averaged)."""
    for opt in (dict(optimizer="sgd", lr=0.05), dict(optimizer="adam")):
        config = quick(clients=1, local_epochs=2, **opt)
        reference = global_weights(train(1, algorithm="centralized", **config))
        personal = train(1, algorithm="sglr", cut="1,2", **config).algorithm.personal_model(0)
        assert max_abs_difference({k: t for part in personal for k, t in part.items()}, reference) <= 1e-5


SAMPLES, CLIENTS, PER_SAMPLE = 300, 3, 200 * 4
CLIENT_PART = (13_000 + 2_010) * 4


def test_ledger_counts_four_kinds_and_no_labels():
    ledger = train(1, **quick(algorithm="sfl_v1", cut="1,2")).ledger.state_dict()
    assert ledger == {
        "smashed": SAMPLES * PER_SAMPLE,  # 240,000
        "server_output": SAMPLES * PER_SAMPLE,
        "tail_grad": SAMPLES * PER_SAMPLE,
        "cut_grad": SAMPLES * PER_SAMPLE,
        "client_model_down": CLIENTS * CLIENT_PART,  # 180,120
        "client_model_up": CLIENTS * CLIENT_PART,
    }


def test_one_step_by_hand():
    """One batch of 32: 32 x 800 bytes of each of the four kinds, nothing else."""
    ledger = train(1, **quick(algorithm="psl", cut="1,2", clients=1, local_steps=1)).ledger.state_dict()
    assert ledger == {kind: 32 * PER_SAMPLE for kind in ("smashed", "server_output", "tail_grad", "cut_grad")}


@pytest.mark.parametrize("algorithm", ["sfl_v1", "sfl_v2", "sl", "psl", "sglr"])
def test_serialized_equals_direct(algorithm):
    config = quick(algorithm=algorithm, cut="1,2", rounds=1)
    direct = train(1, **config)
    serialized = train(1, transport="serialized", **config)
    assert serialized.ledger.envelope_bytes > 0
    assert serialized.ledger.state_dict() == direct.ledger.state_dict()
    for client in direct.clients:  # personal parts (psl) and the global model alike
        here, there = direct.algorithm.personal_model(client.id), serialized.algorithm.personal_model(client.id)
        assert all(max_abs_difference(a, b) == 0 for a, b in zip(here, there))


@pytest.mark.parametrize("algorithm", ["psl", "sfl_v2"])
def test_resumed_equals_straight(algorithm):
    straight, resumed = straight_and_resumed(2, **quick(algorithm=algorithm, cut="1,2"))
    for client in straight.clients:
        here, there = straight.algorithm.personal_model(client.id), resumed.algorithm.personal_model(client.id)
        assert all(max_abs_difference(a, b) == 0 for a, b in zip(here, there))


def test_defense_at_the_first_cut(tmp_path):
    """Clipping and int8 compression act on the smashed data at cut A (a quarter of the bytes);
    what crosses at cut B is as computed. The deployed accuracy runs the tail too."""
    config = quick(algorithm="sfl_v1", cut="1,2", rounds=1, test_subset=100, defense="clip:5+quantize:int8")
    summary = run({**config, "out": str(tmp_path / "run")}, progress=False)
    kinds = summary["comm_bytes_by_kind"]
    assert kinds["server_output"] == kinds["tail_grad"] == SAMPLES * PER_SAMPLE
    assert SAMPLES * 200 <= kinds["smashed"] < SAMPLES * PER_SAMPLE / 2
    assert summary["final_accuracy_deployed"] > 0.2


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"cut": "2,1"}, "cut=2,1: the cuts are out of order"),
        ({"cut": "1,1"}, "cut=1,1: the cuts are out of order"),
        ({"cut": "1,x"}, "invalid value '1,x' for cut"),
        ({"cut": "1,2", "tail_cut": 2}, "give it once"),
        ({"algorithm": "splitgp", "cut": "1,2"}, "tail_cut=2 (cut=1,2, U-shaped) does not fit algorithm=splitgp"),
        ({"algorithm": "fsl_sage", "cut": "1,2"}, "does not fit algorithm=fsl_sage"),
        ({"algorithm": "fedavg", "cut": "1,2"}, "does not fit algorithm=fedavg: nothing is split"),
    ],
)
def test_bad_cuts_are_one_line(settings, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_config(quick(**settings))


def test_a_second_cut_beyond_the_model_is_one_line(tmp_path, capsys):
    assert main(["run", *[f"{k}={v}" for k, v in quick(cut="1,3").items()], f"out={tmp_path / 'u'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: cut=1,3: the second cut must be a later cut of this model; valid: [2]"]


def test_label_leak_attacks_the_gradient_at_the_second_cut(tmp_path):
    out = tmp_path / "run"
    run({**quick(algorithm="sfl_v2", cut="1,2", rounds=1, test_subset=100, record=40), "out": str(out)}, progress=False)
    recorded = load_file(out / "record" / "round_0001.safetensors")
    assert recorded["tail_grad"].shape == (40, 200) and recorded["labels"].shape == (40,)
    assert main(["attack", str(out), "attack=label_leak"]) == 0
    result = json.loads((out / "attack.json").read_text())["label_leak"]
    assert result["gradient"] == "tail_grad" and result["samples"] == 40 and 0 <= result["norm_auc"] <= 1
    shutil.rmtree(out / "record")  # unrecorded: held-out samples through the final model, gradients at B
    assert main(["attack", str(out), "attack=label_leak", "targets=50", "aux=50"]) == 0
    result = json.loads((out / "attack.json").read_text())["label_leak"]
    assert result["gradient"] == "tail_grad" and result["samples"] == 50
    assert main(["evaluate", str(out), "rho=0"]) == 0  # the global model assembled head, middle, tail
    evaluation = json.loads((out / "evaluation.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert evaluation["rows"]["generalized"]["accuracy"] == [pytest.approx(summary["final_accuracy"])]


def test_a_u_shaped_server_refuses_labels_and_a_misshapen_gradient_at_the_second_cut():
    """What a server over a network checks (splitlab.net.checks): a U-shaped client's smashed data
    comes without labels, and its gradient at B has the shape and dtype of the output it answers."""
    experiment = train(0, **quick(algorithm="psl", cut="1,2", clients=2, train_subset=100))
    checks, node = Checks(experiment.blueprint), experiment.roles.clients[0]
    node.begin_round(0)
    forward, tail_step = ClientNode.forward.__verb__, ClientNode.tail_step.__verb__
    sent = node.forward(0)
    checks.result("forward", forward, (0,), sent)  # honest: smashed only
    with pytest.raises(Refused, match=r"forward returns exactly \['smashed'\]"):
        checks.result("forward", forward, (0,), {**sent, "labels": torch.zeros(32, dtype=torch.int64)})
    output = torch.zeros(32, 200)
    reply = node.tail_step(0, output)
    checks.result("tail_step", tail_step, (0, output), reply)
    for wrong in (torch.zeros(31, 200), torch.zeros(32, 200, dtype=torch.float64)):
        with pytest.raises(Refused, match="tail_grad is .*, expected torch.float32 \\(32, 200\\)"):
            checks.result("tail_step", tail_step, (0, output), {**reply, "tail_grad": wrong})
