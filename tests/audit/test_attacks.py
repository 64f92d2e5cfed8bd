"""Attacks of a curious server: what they recover falls with depth and defenses; record= and the
`attack` command; the privacy accounting in the summary."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy.stats import rankdata

from helpers import quick, train
from splitlab.audit.inversion import inversion
from splitlab.audit.label_leak import LabelLeak, batch_leaks, cut_gradients, label_leak, per_batch
from splitlab.cli import main
from splitlab.engine import run
from splitlab.privacy.accounting import epsilon
from splitlab.privacy.defenses import parse_defense, received


def digits_attacks(cut: int, defense: str) -> tuple[dict, dict]:
    """Two rounds of SplitFed-v2 on digits, then both attacks against the final model: the server's
    auxiliary data is 200 test samples, the targets the other 160."""
    experiment = train(2, dataset="digits", model="cnn", cut=cut, clients=2, device="cpu", defense=defense)
    client, server = experiment.assemble(experiment.algorithm.global_model())
    x, y, d = experiment.data.test_x, experiment.data.test_y, parse_defense(defense)
    aux, targets, labels = x[:200], x[200:], y[200:]
    scores = inversion(client, d, aux, received(client, targets, d, 1), targets, 20, 0)
    leak = label_leak(cut_gradients(client, server, targets, labels, d, 32, 0), labels)
    return scores, leak


def test_reconstruction_falls_with_depth_and_noise_and_label_leak_falls_with_gradient_noise():
    shallow, leak = digits_attacks(1, "none")
    deep, _ = digits_attacks(3, "none")
    noised, _ = digits_attacks(1, "noise:2")
    _, protected = digits_attacks(1, "gradnoise:1")
    assert shallow["ssim"] > shallow["baseline"]["ssim"] + 0.3  # the attack works at a shallow cut
    assert shallow["ssim"] > deep["ssim"] and shallow["psnr"] > deep["psnr"]
    assert shallow["ssim"] > noised["ssim"] + 0.2 and shallow["psnr"] > noised["psnr"]
    assert leak["direction_auc"] > 0.9 and protected["direction_auc"] < 0.7


def test_label_leak_scores_separate_classes_by_gradient_direction():
    torch.manual_seed(0)
    labels = torch.arange(40) % 4
    directions = torch.eye(4, 16)[labels]
    aligned = label_leak(directions * torch.rand(40, 1) + 0.01 * torch.randn(40, 16), labels)
    assert aligned["direction_auc"] == 1.0
    assert 0.3 < label_leak(torch.randn(40, 16), labels)["direction_auc"] < 0.7


def test_label_leak_per_batch_scores_each_batch_of_both_classes_and_takes_quantiles():
    """By hand: batch 0 separates by norm (AUC 1) and by direction (the known positive and the other
    share e1, the negatives lie along e2: AUC 1); batch 1 reverses the norms (AUC 0) and points
    every gradient along e1 (all cosines 1, ties: AUC 0.5); batch 2 holds one class, batch 3 one
    positive (no second to score) and -1 samples of a batch cut short: all left out. Medians (0.5,
    0.75), 95% quantiles by linear interpolation between the two batches (0.95, 0.975)."""
    e1, e2 = torch.eye(2)
    grads = torch.stack([3 * e1, 4 * e1, e2, 2 * e2, e1, 2 * e1, 3 * e1, 4 * e1, e1, e2, e1, e1, e2, e2, e1, e1, e2])
    labels = torch.tensor([1, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0])
    batches = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, -1, -1, -1])
    leaks = batch_leaks(grads, labels, batches, majority=True)
    assert (leaks["norm"], leaks["direction"]) == ([1.0, 0.0], [1.0, 0.5])
    found = per_batch([leaks])["per_batch"]
    assert {k: found[k] for k in ("batches", "norm_auc_median", "norm_auc_q95", "norm_auc_mean")} == pytest.approx(
        {"batches": 2, "norm_auc_median": 0.5, "norm_auc_q95": 0.95, "norm_auc_mean": 0.5}
    )
    assert (found["direction_auc_median"], found["direction_auc_q95"]) == pytest.approx((0.75, 0.975))
    assert per_batch([]) == {} and per_batch([batch_leaks(grads[8:11], labels[8:11], batches[8:11], True)]) == {}
    pooled = {"norm_auc": 0.5, "direction_auc": 0.5, "scored": "AUC for the positive class 1"}
    (row,) = [value for name, value in LabelLeak.rows({**pooled, **per_batch([leaks])}) if "per batch" in name]
    assert row.startswith("norm 0.500 / 0.950, direction 0.750 / 0.975, cluster ")


def test_record_and_the_attack_command(tmp_path, capsys):
    out = tmp_path / "run"
    run({**quick(algorithm="sfl_v2", record=50, defense="quantize:int8"), "out": str(out)}, progress=False)
    record = load_file(out / "record" / "round_0002.safetensors")  # rounds numbered from 1, as metrics.jsonl
    weights = {name for name in record if name.startswith("weights.")}  # each client's part the round started with
    assert set(record) - weights == {"inputs", "smashed", "labels", "clients", "batches", "cut_grad"}
    assert weights == {f"weights.{k}.fc1.1.{p}" for k in (0, 1) for p in ("weight", "bias")}
    assert len(record["labels"]) == 50 and record["smashed"].shape == record["cut_grad"].shape == (50, 200)
    assert record["smashed"].dtype == torch.float32 and record["inputs"].shape == (50, 1, 8, 8)
    assert main(["attack", str(out), "attack=label_leak"]) == 0
    assert main(["attack", str(out), "attack=inversion", "epochs=1", "aux=100"]) == 0
    results = json.loads((out / "attack.json").read_text())
    assert set(results["label_leak"]["by_round"]) == {"1", "2"} and results["inversion"]["samples"] == 50
    assert (out / "attack_inversion.png").is_file()
    capsys.readouterr()
    for args, message in [
        (["attack=blur"], "invalid value 'blur' for attack"),
        (["attack=inversion", "round=7"], "round 7 was not recorded"),
        (["attack=inversion", "bogus=1"], "unknown key 'bogus'"),
        (["attack=inversion", "round=0"], "invalid value 0 for round"),
        (["attack=inversion", "client=1"], "client=1 does not apply"),
    ]:
        assert main(["attack", str(out), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err


def test_a_tables_rows_are_inverted_and_scored_per_column_without_a_picture(tmp_path, capsys):
    out = tmp_path / "table"
    run(
        dict(dataset="breast_cancer", model="mlp", clients=1, device="cpu", local_steps=5, out=str(out)), progress=False
    )
    assert main(["attack", str(out), "attack=inversion", "epochs=5", "targets=50"]) == 0
    result = json.loads((out / "attack.json").read_text())["inversion"]
    assert len(result["r2_by_column"]) == 30 and result["baseline"]["r2"] < 0.05 < 0.3 < result["decoder"]["r2"]
    assert "R^2 per column / MSE (decoder)" in capsys.readouterr().out and not (out / "attack_inversion.png").exists()
    for attack in ("unsplit", "fsha"):  # refused from what they declare they need, before any work
        assert main(["attack", str(out), f"attack={attack}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"attack={attack} does not apply to" in err, err
        assert "(it needs images; this run has table rows)" in err, err
    assert main(["attack", str(out), "attack=bisr"]) == 2
    assert "(it needs tokens; this run has table rows)" in capsys.readouterr().err


def test_label_leak_is_refused_where_no_cut_gradient_is_sent(tmp_path, capsys):
    out = tmp_path / "cse"
    run({**quick(algorithm="cse_fsl", record=20, rounds=1), "out": str(out)}, progress=False)
    assert "cut_grad" not in load_file(out / "record" / "round_0001.safetensors")
    assert main(["attack", str(out), "attack=label_leak"]) == 2
    assert "sends no cut gradients" in capsys.readouterr().err


def test_attack_is_refused_where_nothing_is_split(tmp_path, capsys):
    out = tmp_path / "fedavg"
    run({**quick(algorithm="fedavg", rounds=1), "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=inversion"]) == 2
    assert "no cut to attack" in capsys.readouterr().err


def test_attack_on_personal_client_parts_takes_the_chosen_clients_model(tmp_path, capsys):
    out = tmp_path / "psl"
    run({**quick(algorithm="psl", rounds=1, clients=2), "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=label_leak", "client=1"]) == 0
    assert main(["attack", str(out), "attack=label_leak", "client=2"]) == 2
    assert "client=2 is not a client" in capsys.readouterr().err


def test_attack_checks_every_recorded_tensor_before_it_trusts_it(tmp_path, capsys):
    """A record file that is not this run's (a stray file, wrong names, dtypes, widths, lengths,
    NaN, labels out of range) is refused in one line, before any attack runs."""
    from safetensors.torch import save_file

    out = tmp_path / "run"
    run({**quick(algorithm="sfl_v2", record=20, rounds=1), "out": str(out)}, progress=False)
    good = load_file(out / "record" / "round_0001.safetensors")
    damaged = {
        "a NaN": {**good, "smashed": good["smashed"].clone().fill_(float("nan"))},
        "too narrow": {**good, "smashed": good["smashed"][:, :7].contiguous()},
        "float labels": {**good, "labels": good["labels"].float()},
        "labels out of range": {**good, "labels": good["labels"] + 100},
        "one length": {**good, "inputs": good["inputs"][:3].contiguous()},
        "an extra name": {**good, "weights": good["smashed"].clone()},
        "a missing name": {k: v for k, v in good.items() if k != "inputs"},
        "batch numbers below -1": {**good, "batches": good["batches"] - 2},
        "float batch numbers": {**good, "batches": good["batches"].float()},
    }
    for case, tensors in damaged.items():
        save_file(tensors, out / "record" / "round_0001.safetensors")
        assert main(["attack", str(out), "attack=label_leak"]) == 2, case
        err = capsys.readouterr().err
        said = "holds non-finite values ('smashed'" if case == "a NaN" else "is not a record of this run"
        assert err.count("\n") == 1 and said in err, case
    save_file(good, out / "record" / "round_0001.safetensors")
    (out / "record" / "notes.txt").write_text("mine")
    assert main(["attack", str(out), "attack=label_leak"]) == 2
    assert "notes.txt' is not a recorded round" in capsys.readouterr().err
    (out / "record" / "notes.txt").unlink()
    (out / "record" / "round_0002.safetensors").write_bytes(b"garbage")
    assert main(["attack", str(out), "attack=label_leak"]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_epsilon_is_reported_where_clip_and_noise_apply(tmp_path):
    summary = run({**quick(defense="clip:1+noise:2", rounds=1), "out": str(tmp_path / "dp")}, progress=False)
    assert summary["privacy"]["epsilon"] == pytest.approx(epsilon(1.0, 1))
    assert summary["privacy"]["releases_per_sample"] == 1
    assert epsilon(1.0, 10) > epsilon(1.0, 1) > epsilon(2.0, 1)
    noise_only = run({**quick(defense="noise:2", rounds=1), "out": str(tmp_path / "noise")}, progress=False)
    assert noise_only["privacy"]["epsilon"] is None
    assert "privacy" not in run({**quick(rounds=1), "out": str(tmp_path / "plain")}, progress=False)


def planted_norm_leak(labels: torch.Tensor) -> torch.Tensor:
    """Gradients in random directions whose norm is label + 1: a perfect norm leak."""
    return torch.nn.functional.normalize(torch.randn(len(labels), 16), dim=1) * (labels.float() + 1).view(-1, 1)


@pytest.mark.parametrize("classes", [2, 10])
def test_norm_attack_sees_a_planted_perfect_leak(classes):
    labels = torch.arange(200) % classes
    assert label_leak(planted_norm_leak(labels), labels)["norm_auc"] == pytest.approx(1.0)


def rank_auc(score: np.ndarray, positive: np.ndarray) -> float:
    """ROC AUC as the Mann-Whitney statistic (ties count half), written here independently."""
    ranks = rankdata(score)
    n_pos, n_neg = positive.sum(), (~positive).sum()
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def test_label_leak_matches_li_et_al_on_digits_zero_versus_rest():
    """Li et al. 2022's setting: imbalanced binary labels (digit 0 against the rest), a split MLP
    trained a little, per-sample cut gradients of the mean batch loss; their norm attack (AUC of
    the gradient norm for the positive class) and cosine attack (cosine to one known positive)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target == 0, dtype=torch.int64)
    torch.manual_seed(0)
    client, server = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()), torch.nn.Linear(32, 2)
    optimizer = torch.optim.SGD([*client.parameters(), *server.parameters()], lr=0.1)
    grads = []
    for start in range(0, len(y), 64):
        xb, yb = x[start : start + 64], y[start : start + 64]
        smashed = client(xb)
        cut = smashed.detach().requires_grad_()
        loss = torch.nn.functional.cross_entropy(server(cut), yb)
        optimizer.zero_grad()
        loss.backward()
        grads.append(cut.grad.clone())
        smashed.backward(cut.grad)
        optimizer.step()
    g, positive = torch.cat(grads).numpy(), y.numpy() == 1
    theirs_norm = rank_auc(np.linalg.norm(g, axis=1), positive)
    known = int(np.flatnonzero(positive)[0])
    others = np.arange(len(y)) != known
    cosine = g @ g[known] / (np.linalg.norm(g, axis=1) * np.linalg.norm(g[known]))
    theirs_cosine = rank_auc(cosine[others], positive[others])
    ours = label_leak(torch.cat(grads), y)
    assert theirs_norm > 0.7  # the leak is there to see
    assert abs(ours["norm_auc"] - theirs_norm) < 0.05 and abs(ours["direction_auc"] - theirs_cosine) < 0.05
