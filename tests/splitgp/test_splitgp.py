"""SplitGP: training reductions and mixing, the entropy gate, the per-client evaluation, the
inference-time model (hand-computed for the paper's CNN) and the paper's shard partition."""

from __future__ import annotations

import copy
import json
import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from helpers import client_model, global_weights, max_abs_difference, node, quick, server_model, sync_model, train
from splitlab.cli import main
from splitlab.data import partition
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.finished_run import global_states, load_run
from splitlab.splitgp_evaluation import (
    ENTROPY_GRID,
    EvaluationSettings,
    _views,
    entropy,
    gated_predict,
    nested_view,
    to_server,
    training_set,
)
from splitlab.splitgp_latency import (
    RateThreshold,
    SplitSizes,
    client_power_threshold,
    max_client_part,
    rate_threshold,
    split_sizes,
    table_one,
)

GP = dict(algorithm="splitgp", cut=1, partition="shards:2")


# --- training ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "opt", [dict(optimizer="sgd", lr=0.05), dict(optimizer="adam", lr=1e-3)], ids=lambda o: o["optimizer"]
)
@pytest.mark.parametrize("cut", [1, 2])
def test_gamma0_lambda0_is_splitfed_v1(opt, cut):
    config = quick(partition="dirichlet:0.5", cut=cut, **opt)
    sfl = train(2, algorithm="sfl_v1", **config)
    gp = train(2, algorithm="splitgp", gamma=0, personalization=0, **config)
    reference = global_weights(sfl)
    assert max_abs_difference(reference, global_weights(train(0, algorithm="sfl_v1", **config))) > 1e-3
    assert max_abs_difference(global_weights(gp), reference) <= 1e-6
    for k in range(3):  # every client holds the averaged client part
        assert max_abs_difference(client_model(gp, k).state_dict(), sync_model(sfl).state_dict()) <= 1e-6


def test_lambda_mixes_each_client_with_the_average_exactly():
    """One round: training is the same for every lambda; only the final mixing (eqs. 9-10) differs."""
    config = quick(optimizer="sgd", lr=0.05, **GP)
    own = train(1, personalization=1.0, **config)
    half = train(1, personalization=0.5, **config)
    shared = train(1, personalization=0.0, **config)
    average = sync_model(own).state_dict()
    assert max_abs_difference(average, sync_model(shared).state_dict()) == 0
    for k in range(3):
        mine = client_model(own, k).state_dict()
        assert max_abs_difference(mine, average) > 1e-3  # lambda = 1: un-averaged
        expected = {n: 0.5 * mine[n] + 0.5 * average[n] for n in mine}
        assert max_abs_difference(client_model(half, k).state_dict(), expected) <= 1e-7
        assert max_abs_difference(client_model(shared, k).state_dict(), average) == 0  # lambda = 0: all equal
        assert (
            max_abs_difference(
                client_model(shared, k, "aux_model").state_dict(), sync_model(shared, "aux_model").state_dict()
            )
            == 0
        )
    assert (
        max_abs_difference(
            client_model(own, 0, "aux_model").state_dict(), client_model(own, 1, "aux_model").state_dict()
        )
        > 1e-4
    )


def test_one_step_follows_the_multi_exit_objective():
    """One client, one batch, SGD: phi, h and theta move by -lr * grad of
    gamma * CE(h(phi(x))) + (1 - gamma) * CE(theta(phi(x))), computed here without any split."""
    gamma, lr = 0.3, 0.1
    experiment = train(0, **quick(clients=1, batch_size=300, optimizer="sgd", lr=lr, gamma=gamma, **GP))
    models = client_model(experiment, 0), client_model(experiment, 0, "aux_model"), server_model(experiment)
    phi, h, theta = (copy.deepcopy(m) for m in models)
    x, y = node(experiment, 0).x, node(experiment, 0).y
    features = phi(x)
    loss = gamma * F.cross_entropy(h(features), y) + (1 - gamma) * F.cross_entropy(theta(features), y)
    loss.backward()
    experiment.algorithm.run_round(0, experiment.clients)
    for reference, trained in zip((phi, h, theta), models):
        expected = {n: p.detach() - lr * p.grad for n, p in reference.named_parameters()}
        assert max_abs_difference(trained.state_dict(), expected) <= 1e-6


def test_bytes_of_one_round_against_shapes():
    # 3 clients x 100 samples, MLP 64-200-200-10 cut 1: phi = 13,000 params, h = 200*10+10 = 2,010.
    experiment = train(1, **quick(clients=3, **GP))
    phi, h, smashed, label = 13_000 * 4, 2_010 * 4, 200 * 4, 8
    assert experiment.ledger.state_dict() == {
        "smashed": 300 * smashed,
        "labels": 300 * label,
        "cut_grad": 300 * smashed,
        "client_model_up": 3 * phi,
        "aux_model_up": 3 * h,
        "client_model_down": 2 * 3 * phi,
        "aux_model_down": 2 * 3 * h,  # initial copies + one mixing round
    }


def test_interrupted_run_resumes_to_the_same_clients(tmp_path, monkeypatch):
    config = quick(rounds=3, out=str(tmp_path / "a"), **GP)
    run(config, progress=False)
    from splitlab.algorithms.splitgp import SplitGP

    original = SplitGP.train_round

    def crash_in_round_2(self, rnd, clients):
        if rnd == 2:
            raise KeyboardInterrupt
        original(self, rnd, clients)

    monkeypatch.setattr(SplitGP, "train_round", crash_in_round_2)
    with pytest.raises(KeyboardInterrupt):
        run({**config, "out": str(tmp_path / "b")}, progress=False)
    monkeypatch.setattr(SplitGP, "train_round", original)
    run({**config, "out": str(tmp_path / "b"), "resume": True}, progress=False)
    a, b = load_file(tmp_path / "a" / "clients.safetensors"), load_file(tmp_path / "b" / "clients.safetensors")
    assert a.keys() == b.keys() and len(a) == 3 * 2 * 2  # 3 clients x (phi, h) x (weight, bias)
    assert max_abs_difference(a, b) == 0


# --- the entropy gate ---------------------------------------------------------------------------------
def test_gate_sends_exactly_the_samples_whose_entropy_exceeds_the_threshold():
    logits = torch.tensor([[9.0, 0, 0], [1.0, 0, 0], [0.0, 0, 0], [0.5, 0.4, 0.3]])
    h = entropy(logits)
    assert torch.allclose(h[2], torch.tensor(math.log(3)))
    threshold = float(h[1])
    assert to_server(logits, threshold).tolist() == [False, False, True, True]  # equal stays at the client
    just_below = float(np.nextafter(np.float32(threshold), np.float32(0)))  # entropies are float32
    assert to_server(logits, just_below).tolist() == [False, True, True, True]


@pytest.mark.parametrize("transport", ["direct", "serialized"])
def test_deployed_gate_sends_the_routed_features_through_the_transport(transport):
    experiment = train(1, **quick(transport=transport, **GP))  # MLP cut 1: 200 features at the cut
    x = node(experiment, 0).x
    with torch.no_grad():
        features = client_model(experiment, 0)(x)
        client_logits = client_model(experiment, 0, "aux_model")(features)
        server_logits = server_model(experiment)(features)
    threshold = float(entropy(client_logits).median())
    before = experiment.ledger.state_dict()
    logits = experiment.algorithm.client(0).infer(x)
    assert torch.allclose(logits, client_logits)
    predictions, routed = gated_predict(experiment, 0, logits, len(x), threshold)
    assert routed.tolist() == (entropy(client_logits) > threshold).tolist() and 0 < routed.sum() < len(x)
    assert torch.equal(predictions, torch.where(routed, server_logits.argmax(1), client_logits.argmax(1)))
    after = experiment.ledger.state_dict()  # the routed samples' features, and nothing else, were counted
    assert {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)} == {
        "smashed": int(routed.sum()) * 200 * 4
    }


# --- the per-client evaluation ------------------------------------------------------------------------
def test_nested_view_holds_all_main_samples_and_rho_times_as_many_others():
    labels = np.repeat(np.arange(5), 20)
    indices, n_main = nested_view(labels, np.arange(100), np.array([1, 3]), 0.8, np.random.default_rng(0))
    assert n_main == 40 and sorted(indices[:40]) == sorted(np.flatnonzero(np.isin(labels, [1, 3])))
    assert len(indices) == 40 + 32 and not np.isin(labels[indices[40:]], [1, 3]).any()
    assert len(set(indices)) == len(indices)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    config = quick(
        clients=5, rounds=3, optimizer="sgd", lr=0.05, train_subset=500, test_subset=300, partition="shards:2"
    )
    run({**config, "algorithm": "splitgp", "cut": 1, "out": str(root / "gp")}, progress=False)
    run({**config, "algorithm": "fedavg", "out": str(root / "fedavg")}, progress=False)
    return root


def test_evaluate_splitgp_run(runs, capsys):
    assert main(["evaluate", str(runs / "gp"), "rho=0,0.4,0.8", "entropy_threshold=1e9"]) == 0
    result = json.loads((runs / "gp" / "evaluation.json").read_text())
    rows = result["rows"]
    assert set(rows) == {"splitgp", "client model", "full model", "splitgp (E_th chosen on test)"}
    assert rows["splitgp"]["accuracy"] == rows["client model"]["accuracy"]  # nothing leaves the client
    assert rows["splitgp"]["client_fraction"] == [1.0] * 3 and rows["full model"]["client_fraction"] == [0.0] * 3
    for row in rows.values():  # 200 floats cross per routed sample
        assert row["bytes_sent"] == [n * 200 * 4 for n in row["samples_sent"]]
    assert main(["evaluate", str(runs / "gp"), "rho=0.2"]) == 0  # auto
    chosen = json.loads((runs / "gp" / "evaluation.json").read_text())["rows"]["splitgp"]["entropy_threshold"]
    assert len(chosen) == 1 and chosen[0] in ENTROPY_GRID


def test_threshold_is_chosen_on_training_samples_the_client_never_saw(runs):
    experiment = load_run(runs / "gp")
    train_set = training_set(experiment)
    views = _views(experiment, train_set, EvaluationSettings(validation_size=7, rho=[0.5]), test=False)
    labels = train_set.y.numpy()
    for k, (own, (indices, n_main)) in enumerate(zip(train_set.owned, views)):
        assert torch.equal(node(experiment, k).y, train_set.y[own])  # the client's samples, as trained on
        assert n_main == 7 and len(indices) == 7 + 4 and not np.isin(indices, own).any()
        assert np.isin(labels[indices[:7]], labels[own]).all()


def test_generalized_row_is_the_global_model_on_each_clients_main_classes(runs):
    assert main(["evaluate", str(runs / "fedavg"), "rho=0,0.6", "finetune_rounds=1"]) == 0
    rows = json.loads((runs / "fedavg" / "evaluation.json").read_text())["rows"]
    assert set(rows) == {"generalized", "personalized"}
    experiment = load_run(runs / "fedavg")
    with torch.no_grad():
        predicted = experiment.assemble(global_states(experiment))(experiment.data.test_x).argmax(1).numpy()
    train_set = training_set(experiment)
    test_y, train_y = experiment.data.test_y.numpy(), train_set.y.numpy()
    per_client = [np.mean((predicted == test_y)[np.isin(test_y, train_y[own])]) for own in train_set.owned]
    assert rows["generalized"]["accuracy"][0] == pytest.approx(np.mean(per_client), abs=1e-6)
    assert rows["personalized"]["accuracy"] != rows["generalized"]["accuracy"]


def test_evaluate_mistakes_exit_2(runs, tmp_path, capsys):
    assert main(["evaluate", str(tmp_path)]) == 2
    assert main(["evaluate", str(runs / "gp"), "rho=-1"]) == 2
    assert main(["evaluate", str(runs / "gp"), "entropy_threshold=high"]) == 2
    assert main(["evaluate", str(runs / "gp"), "rho=9"]) == 2  # not enough other-class samples
    assert main(["latency", "beta=2"]) == 2 and main(["latency", "speed=1"]) == 2
    assert all(line.startswith("error: ") for line in capsys.readouterr().err.strip().splitlines())


@pytest.mark.parametrize(
    "damage",
    [
        ("clients.safetensors", b"not a safetensors file"),
        ("weights.safetensors", None),  # missing
        ("clients.safetensors", "other"),  # another run's tensors
        ("config.yaml", b"algorithm: [splitgp"),
        ("config.yaml", b"- a list"),
    ],
    ids=["garbage", "missing", "foreign", "bad yaml", "not a mapping"],
)
def test_damaged_run_files_are_one_line_errors(runs, tmp_path, capsys, damage):
    name, content = damage
    copy_of = tmp_path / "gp"
    shutil.copytree(runs / "gp", copy_of)
    if content is None:
        (copy_of / name).unlink()
    elif content == "other":
        (copy_of / name).write_bytes((runs / "fedavg" / "weights.safetensors").read_bytes())
    else:
        (copy_of / name).write_bytes(content)
    assert main(["evaluate", str(copy_of), "rho=0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1


# --- the inference-time model ---------------------------------------------------------------------------
PAPER = SplitSizes(phi=387_840, theta=3_480_330, head=23_050, q=784, q_c=2_304)


def test_zoo_sizes_match_the_paper():
    assert split_sizes("splitgp_cnn", 4) == PAPER  # q_c = 256 x 3 x 3 at cut 4


def test_table_one_for_the_paper_cnn_by_hand():
    # Fig. 3 settings: P_S = 100, P_C = 20, R = 1, beta = 0.1, |D| = 1.
    table = table_one(PAPER, 20, 100, 1, 0.1)
    assert table["full model at client"] == dict(
        storage=3_868_170, computation=3_868_170, communication=0, latency=pytest.approx(193_408.5)
    )
    assert table["full model at server"] == dict(
        storage=0, computation=0, communication=784, latency=pytest.approx(784 + 38_681.7)
    )
    gp = table["splitgp"]
    assert (gp["storage"], gp["computation"]) == (410_890, 410_890) and gp["communication"] == pytest.approx(230.4)
    assert gp["latency"] == pytest.approx(20_544.5 + 230.4 + 34_803.3 * 0.1)
    assert table_one(PAPER, 20, 100, 1, 0.1, samples=7)["splitgp"]["latency"] == pytest.approx(7 * gp["latency"])


def test_propositions_by_hand_and_against_direct_comparison():
    # Prop. 2: (|theta| - |h|) / (beta (q_c / R + |theta| / P_S)) = 3,457,280 / (0.1 * 37,107.3)
    assert client_power_threshold(PAPER, 100, 1, 0.1) == pytest.approx(3_457_280 / 3_710.73)
    assert client_power_threshold(PAPER, 100, 1, 0.0) == math.inf
    # Prop. 3 at the paper's settings: client work (20,544.5) < server saving (35,201.37): always faster.
    assert rate_threshold(PAPER, 20, 100, 0.1) == RateThreshold("<=", math.inf)
    # A slow client (P_C = 5): threshold = (784 - 230.4) / (82,178 - 35,201.37).
    slow = rate_threshold(PAPER, 5, 100, 0.1)
    assert slow.op == "<=" and slow.value == pytest.approx(553.6 / (82_178 - 35_201.37))
    for p_c, rate in [(5, 0.01), (5, 0.02), (900, 1), (950, 1)]:
        t = table_one(PAPER, p_c, 100, rate, 0.1)
        latency = t["splitgp"]["latency"]
        faster_than_client = p_c <= client_power_threshold(PAPER, 100, rate, 0.1)
        assert (latency <= t["full model at client"]["latency"]) == faster_than_client
        assert (latency <= t["full model at server"]["latency"]) == rate_threshold(PAPER, p_c, 100, 0.1).holds(rate)
    # Prop. 1: at the largest feasible |phi| (|w| fixed) the latency per sample is the budget.
    bound = max_client_part(PAPER, 20, 100, 1, 0.1, budget=30_000)
    at_bound = SplitSizes(phi=bound, theta=PAPER.full - bound, head=PAPER.head, q=PAPER.q, q_c=PAPER.q_c)
    assert table_one(at_bound, 20, 100, 1, 0.1)["splitgp"]["latency"] == pytest.approx(30_000)
    assert bound == pytest.approx(2000 * (30_000 - 230.4 - 1_152.5 - 3_868.17) / 98)


def test_latency_command_prints_table_one(capsys):
    assert main(["latency", "model=splitgp_cnn", "cut=4", "beta=0.1", "latency_budget=30000"]) == 0
    out = capsys.readouterr().out
    assert "387,840" in out and "24,255.2" in out and "931.698" in out


# --- the paper's partition ----------------------------------------------------------------------------
def test_shards_match_the_paper_100_shards_2_per_client():
    labels = np.repeat(np.arange(10), 6000)  # Fashion-MNIST's training labels, sorted
    parts = partition(labels, 50, "shards:2", seed=0)
    assert sorted(np.concatenate(parts).tolist()) == list(range(60_000))
    for part in parts:
        counts = np.bincount(labels[part], minlength=10)
        assert len(part) == 1200 and set(counts.tolist()) <= {0, 600, 1200}  # two whole shards of 600


def test_rate_threshold_is_a_lower_bound_when_numerator_and_denominator_are_negative():
    # Paper's cut-4 sizes, beta = 0.5, P_C = 20, P_S = 100: num = 784 - 1,152 = -368,
    # den = 20,544.5 - 21,280.05 = -735.55, so SplitGP is faster for R >= 0.50 (not "never").
    threshold = rate_threshold(PAPER, 20, 100, 0.5)
    assert threshold.op == ">=" and threshold.value == pytest.approx(368 / 735.55)
    assert str(threshold) == "iff R >= 0.500306"
    for rate in (0.1, 0.45, 0.55, 1, 10):
        t = table_one(PAPER, 20, 100, rate, 0.5)
        assert (t["splitgp"]["latency"] <= t["full model at server"]["latency"]) == threshold.holds(rate)


def test_rho_that_cannot_be_met_says_why_and_what_to_do():
    labels = np.repeat(np.arange(5), 20)
    with pytest.raises(
        UserError,
        match=r"rho=0.2 cannot be met on partition=iid: client 3 holds all 5 classes.*"
        r"evaluate with rho=0, or train on a partition",
    ):
        nested_view(
            labels, np.arange(100), np.arange(5), 0.2, np.random.default_rng(0), who="client 3", partition="iid"
        )
    with pytest.raises(
        UserError,
        match=r"needs 72 out-of-distribution samples for a client, which has only 60 "
        r"\(beside 40 of its own classes\); use rho <= 1.5",
    ):
        nested_view(labels, np.arange(100), np.array([1, 3]), 1.8, np.random.default_rng(0))


def test_evaluate_on_an_iid_run_explains_rho_in_one_line(tmp_path, capsys):
    run(
        {
            **quick(clients=2, rounds=1, train_subset=200, test_subset=100, partition="iid"),
            "algorithm": "fedavg",
            "out": str(tmp_path / "iid"),
        },
        progress=False,
    )
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "iid"), "rho=0,0.2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "on partition=iid" in err and "holds all 10 classes" in err and "rho=0" in err
