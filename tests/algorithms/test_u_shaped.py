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

from helpers import DropsOut, global_weights, max_abs_difference, quick, server_model, straight_and_resumed, train
from splitlab.build import build
from splitlab.cli import main
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.net.checks import Checks, Refused
from splitlab.resolve import resolve_config
from splitlab.u_shaped import UShapedClient

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
    forward, tail_step = UShapedClient.forward.__verb__, UShapedClient.tail_step.__verb__
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


# --- CycleSL U-shaped: the server task and ServerGrad through the clients' tails ---------------
CYCLES = ["cycle_psl", "cycle_sglr", "cycle_sfl", "cycle_ssl"]


def whole_model(experiment, client_id: int = 0) -> dict[str, torch.Tensor]:
    """Client `client_id`'s whole model (head, middle and tail, or client and server part)."""
    return {k: t for part in experiment.algorithm.personal_model(client_id) for k, t in part.items()}


@pytest.mark.parametrize(
    "algorithm,opt",
    [
        ("cycle_psl", OPTIMIZERS[0]),
        ("cycle_psl", OPTIMIZERS[1]),
        ("cycle_sglr", OPTIMIZERS[1]),
        ("cycle_sfl", OPTIMIZERS[0]),
        ("cycle_ssl", OPTIMIZERS[0]),
    ],
    ids=lambda v: v if isinstance(v, str) else v["optimizer"],
)
def test_u_shaped_cycle_with_one_client_equals_vanilla(algorithm, opt):
    """With one client and server_lr unset, the tail's steps in the server task are the vanilla
    server part's last layers' (the optimizers are per parameter): the same model, bit for bit,
    over two rounds of two resampled server epochs. cycle_sfl and cycle_ssl start their client
    optimizer afresh every round, the vanilla server's lives on: equal with SGD, not with Adam."""
    config = quick(algorithm=algorithm, clients=1, server_epochs=2, server_batch_size=16, **opt)
    vanilla, u_shaped = whole_model(train(2, **config)), whole_model(train(2, cut="1,2", **config))
    assert u_shaped.keys() == vanilla.keys()
    assert max_abs_difference(u_shaped, vanilla) <= 1e-6
    assert max_abs_difference(vanilla, whole_model(train(0, **config))) > 1e-3


def test_u_shaped_cycle_sfl_with_adam_differs_from_vanilla_after_a_round():
    """The exception above: the tail's Adam moments start afresh in round 2 (the client's optimizer
    does), the vanilla server part's do not; equal after the first round, not after the second."""
    config = quick(algorithm="cycle_sfl", clients=1, **OPTIMIZERS[1])
    assert max_abs_difference(whole_model(train(1, cut="1,2", **config)), whole_model(train(1, **config))) <= 1e-6
    assert max_abs_difference(whole_model(train(2, cut="1,2", **config)), whole_model(train(2, **config))) > 1e-4


def test_u_shaped_cycle_loss_shares_add_up_to_the_vanilla_weighted_loss():
    """Three clients of unequal sizes, one server batch of all their samples: the clients' shares
    (|D_k|-weighted, over the whole batch's weights) sum to vanilla's loss, so the middle takes
    vanilla's step, and with SGD the clients' tail steps add up to the vanilla tail's."""
    config = quick(algorithm="cycle_psl", partition="dirichlet:0.5", server_batch_size=1000, optimizer="sgd", lr=0.1)
    vanilla, u_shaped = train(1, **config), train(1, cut="1,2", **config)
    assert len({c.num_samples for c in u_shaped.clients}) == 3
    assert u_shaped.algorithm.pop_train_loss() == pytest.approx(vanilla.algorithm.pop_train_loss(), abs=1e-6)
    middle = server_model(u_shaped).state_dict()
    assert max_abs_difference(middle, {k: server_model(vanilla).state_dict()[k] for k in middle}) <= 1e-6
    initial = whole_model(train(0, cut="1,2", **config))
    tail = [k for k in initial if k.startswith("out.")]
    steps = {k: sum(whole_model(u_shaped, c.id)[k] - initial[k] for c in u_shaped.clients) for k in tail}
    assert max_abs_difference(steps, {k: whole_model(vanilla)[k] - initial[k] for k in tail}) <= 1e-6
    assert max(float(t.abs().max()) for t in steps.values()) > 1e-3


def test_u_shaped_cycle_bytes_of_one_round_by_hand():
    """3 clients send one batch of 32 each (96 samples); 2 server epochs of batches of 20 send each
    sample's middle output down and its gradient up twice, ServerGrad once more: 3 x 96 x 800
    bytes of each; smashed data and cut gradients once; no labels."""
    ledger = train(1, **quick(algorithm="cycle_psl", cut="1,2", server_epochs=2, server_batch_size=20)).ledger
    sent = 3 * 32 * PER_SAMPLE
    assert ledger.state_dict() == {"smashed": sent, "server_output": 3 * sent, "tail_grad": 3 * sent, "cut_grad": sent}


@pytest.mark.parametrize("algorithm", CYCLES)
def test_u_shaped_cycle_serialized_equals_direct(algorithm):
    config = quick(algorithm=algorithm, cut="1,2", rounds=1, server_batch_size=20, partition="dirichlet:0.5")
    direct, serialized = train(1, **config), train(1, transport="serialized", **config)
    assert serialized.ledger.envelope_bytes > 0 and "labels" not in direct.ledger.state_dict()
    assert serialized.ledger.state_dict() == direct.ledger.state_dict()
    assert serialized.algorithm.pop_train_loss() == direct.algorithm.pop_train_loss()
    for client in direct.clients:
        assert max_abs_difference(whole_model(direct, client.id), whole_model(serialized, client.id)) == 0


def test_u_shaped_cycle_resumed_equals_straight():
    config = quick(algorithm="cycle_sglr", cut="1,2", optimizer="adam", participation=0.67, server_epochs=2)
    straight, resumed = straight_and_resumed(3, **config)
    for client in straight.clients:
        assert max_abs_difference(whole_model(straight, client.id), whole_model(resumed, client.id)) == 0


def test_u_shaped_cycle_tail_results_pass_the_servers_checks():
    """Over a network the server checks the tails' results as those of `tail_step`: the gradient
    at B of the output it sent, a scalar loss share, nothing else (no labels)."""
    experiment = train(0, **quick(algorithm="cycle_sfl", cut="1,2", clients=2, train_subset=100))
    checks, node = Checks(experiment.blueprint), experiment.roles.clients[0]
    node.begin_round(0)
    node.forward(0)
    pooled, frozen = (getattr(type(node), verb).__verb__ for verb in ("pooled_tail_step", "frozen_tail"))
    args = (0, torch.zeros(5, 200), [0, 3, 4, 7, 9], 50.0, 500.0)
    reply = node.pooled_tail_step(*args)
    checks.result("pooled_tail_step", pooled, args, reply)
    with pytest.raises(Refused, match=r"returns exactly \['loss', 'tail_grad'\]"):
        checks.result("pooled_tail_step", pooled, args, {**reply, "labels": torch.zeros(5, dtype=torch.int64)})
    with pytest.raises(Refused, match="tail_grad is .*, expected torch.float32 \\(5, 200\\)"):
        checks.result("pooled_tail_step", pooled, args, {**reply, "tail_grad": torch.zeros(4, 200)})
    with pytest.raises(ValueError, match="rows outside the batch of 32 samples"):
        node.pooled_tail_step(0, torch.zeros(1, 200), [32], 50.0, 500.0)
    output = torch.zeros(32, 200)
    checks.result("frozen_tail", frozen, (0, output), node.frozen_tail(0, output))


def test_u_shaped_cycle_goes_on_without_a_client_that_drops_out_of_the_server_task():
    """Client 2 leaves at its first share of the server task: its rows give no gradient from then
    on, it is left out of ServerGrad, the others finish the round, and it trains again next round."""
    config = quick(algorithm="cycle_psl", cut="1,2", server_epochs=2, server_batch_size=20)
    leaves = DropsOut.at_call(client=2, at=1, verbs=("pooled_tail_step",))
    experiment = build(config, transport=leaves)
    experiment.algorithm.run_round(0, experiment.clients)
    assert experiment.algorithm.dropped == {2}
    by_client = experiment.ledger.bytes_by_client
    assert by_client[2] == 32 * PER_SAMPLE  # its smashed data, nothing after
    assert by_client[0] == by_client[1] > 5 * 32 * PER_SAMPLE
    experiment.algorithm.run_round(1, experiment.clients)
    assert experiment.algorithm.dropped == set() and experiment.ledger.bytes_by_client[2] > 5 * 32 * PER_SAMPLE
