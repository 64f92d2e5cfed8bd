"""The defense-aware label attacks (splitlab.audit.label_clusters) on constructed batches, checked by
hand, and the averaging attack against noise on each release (splitlab.audit.inversion)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import quick
from splitlab.audit import label_clusters
from splitlab.audit.label_leak import batch_leaks, cut_gradients, label_leak
from splitlab.audit.run import attack_run
from splitlab.cli import main
from splitlab.engine import run
from splitlab.privacy.defenses import Defense


def test_two_means_cuts_where_the_within_cluster_squares_are_least():
    """[0, 0.1, 0.2 | 5, 5.1]: the cut after 0.2 leaves 0.02 + 0.005 of squares, any other cut more;
    threshold midway, 2.6. The larger cluster (below) is the positives': scores -(v - 2.6) / 4.95
    (4.95: the distance between the cluster means, 5.05 and 0.1); with the negatives the majority,
    the signs turn."""
    values = np.array([5.0, 0.0, 0.2, 5.1, 0.1])
    threshold, upper = label_clusters.two_means(values)
    assert threshold == pytest.approx(2.6) and upper.tolist() == [True, False, False, True, False]
    assert label_clusters.cluster_scores(values, majority=True) == pytest.approx(-(values - 2.6) / 4.95)
    assert label_clusters.cluster_scores(values, majority=False) == pytest.approx((values - 2.6) / 4.95)
    assert label_clusters.two_means(np.array([3.0, 3.0]))[1].tolist() == [False, False]
    assert label_clusters.cluster_scores(np.array([3.0, 3.0]), True).tolist() == [0.0, 0.0]


def marvell_like_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Six positives and four negatives whose gradients are mostly noise along e1 of the same sizes
    in both classes (+-10, +-20, +-30 and +-10, +-20), as Marvell puts most of its power along the
    class-difference direction; across it the negatives carry noise of norm 1 (along e3), the
    positives only their own tiny gradient (1e-3 along e2): Marvell noises the class of the
    smaller variance across, and a trained model's gradients are mostly tiny."""
    e1, e2, e3 = torch.eye(3, 4, dtype=torch.float64)
    along = torch.tensor([10.0, -10, 20, -20, 30, -30, 10, -10, 20, -20], dtype=torch.float64)
    across = torch.stack([1e-3 * e2] * 6 + [e3] * 4)
    return along[:, None] * e1 + across, torch.tensor([1] * 6 + [0] * 4)


def test_the_residual_attack_reads_the_labels_where_li_et_al_s_attacks_cannot():
    """By hand: the top principal direction is e1; removed, the residual norms are 1e-3 (positives)
    and 1 (negatives), log -6.9 and 0; 2-means splits there, the larger cluster (6) is called the
    majority class, the positives: AUC 1. The norm attack: the positives' norms (10, 10, 20, 20,
    30, 30) against the negatives' (sqrt(101), sqrt(101), sqrt(401), sqrt(401)) win 12 of the 24
    pairs: AUC 0.5."""
    grads, labels = marvell_like_batch()
    batch = torch.zeros(10, dtype=torch.int64)
    found = label_clusters.scores(grads, batch, majority=True)
    assert (found["residual"][:6] > 0).all() and (found["residual"][6:] < 0).all()
    assert label_clusters.pooled(grads, labels, batch, True)["residual_auc"] == 1.0
    assert label_clusters.pooled(grads, labels, batch, False)["residual_auc"] == 0.0  # the prior turns it
    assert label_leak(grads, labels)["norm_auc"] == 0.5
    leaks = batch_leaks(grads, labels, batch, majority=True)
    assert leaks["residual"] == [1.0] and leaks["norm"] == [0.5]


def test_the_linked_attack_outvotes_randomised_response_across_releases():
    """Seven samples (five positives, A first; two negatives, D first) released in three rounds;
    each gradient is +-e1 by the label *sent* (scores +-0.5: threshold 0, cluster means +-1).
    Round 2 flips A, round 3 flips D: per round the cluster attack's AUC against the truth is 1,
    0.9 (A's -0.5 ties the two negatives': 9 of 10 pairs) and 0.75 (D's +0.5 ties the five
    positives': 7.5 of 10). Linked, A's mean is 1/6, D's
    -1/6, every other positive 0.5, the other negative -0.5: AUC 1."""
    e1 = torch.eye(1, 3)[0]
    truth = torch.tensor([1, 1, 1, 1, 1, 0, 0])
    inputs = torch.arange(7.0)[:, None].repeat(1, 2)
    rounds = []
    for flipped in (None, 0, 5):
        sent = truth.clone()
        if flipped is not None:
            sent[flipped] = 1 - sent[flipped]
        grads = (2.0 * sent - 1)[:, None] * e1
        rounds.append(
            {"inputs": inputs, "labels": truth, "batches": torch.zeros(7, dtype=torch.int64), "cut_grad": grads}
        )
    single = [label_clusters.pooled(r["cut_grad"], truth, r["batches"], True)["cluster_auc"] for r in rounds]
    assert single == pytest.approx([1.0, 0.9, 0.75])
    assert label_clusters.linked(rounds, "cut_grad", True) == {"auc": 1.0, "samples": 7, "releases_mean": 3.0}
    rounds[2]["batches"] = torch.full((7,), -1)  # a batch cut short is not scored, nor linked
    assert label_clusters.linked(rounds, "cut_grad", True)["releases_mean"] == 2.0


BINARY = quick(dataset="breast_cancer", model="mlp", algorithm="sl", clients=2, rounds=2, record=100)


def test_label_leak_reports_the_defense_aware_attacks_and_the_strongest(tmp_path, capsys):
    out = tmp_path / "marvell"
    run({**BINARY, "defense": "marvell", "noise_key": "a", "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=label_leak"]) == 0
    printed = capsys.readouterr().out
    leak = json.loads((out / "attack.json").read_text())["label_leak"]
    per_batch = leak["per_batch"]
    assert {"cluster_auc", "residual_auc"} <= set(leak) and {"cluster_auc", "residual_auc"} <= set(
        leak["by_round"]["2"]
    )
    names = ("norm", "direction", "cluster", "residual")
    medians = {name: per_batch[f"{name}_auc_median"] for name in names}
    best = max(medians, key=lambda name: medians[name])
    (overall,) = [
        row
        for row in json.loads((out / "attack.json").read_text())["strongest"]
        if row["figure"] == "per-batch label AUC (median)"
    ]
    assert (overall["value"], overall["attacker"]) == (medians[best], f"per_batch.{best}_auc_median")
    assert leak["linked"]["samples"] >= 100 and leak["linked"]["releases_mean"] > 1
    assert "Marvell bounds the leak only under its model" in leak["marvell"]
    assert "residual attack AUC" in printed and "strongest per-batch label AUC (median) so far" in printed


def test_label_leak_refuses_a_run_whose_cut_gradients_carry_nothing(tmp_path, capsys):
    """splitgp with gamma = 1 weights the server's loss 0: every cut gradient it sends is zero,
    recorded or not."""
    for record in (0, 20):
        out = tmp_path / f"splitgp{record}"
        run({**quick(algorithm="splitgp", gamma=1.0, rounds=1, record=record), "out": str(out)}, progress=False)
        assert main(["attack", str(out), "attack=label_leak"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "weights the server's loss 0" in err and "gamma=1.0" in err, err


def test_a_record_cut_short_is_refused_without_blaming_one_tensor(tmp_path, capsys):
    out = tmp_path / "run"
    run({**quick(algorithm="sfl_v2", record=20, rounds=1), "out": str(out)}, progress=False)
    file = out / "record" / "round_0001.safetensors"
    good = load_file(file)
    save_file({**good, "labels": good["labels"][:15].contiguous()}, file)
    assert main(["attack", str(out), "attack=label_leak"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "different numbers of samples (batches 20, clients 20, " in err, err
    assert "labels 15" in err


def test_inversion_averages_each_samples_releases_across_the_recorded_rounds(tmp_path):
    """Two clients of 60 digits each, record=200 (every sample, every round) over 3 rounds: each
    recorded sample was released 3 times, so the averaged attack's targets carry noise of a third
    of the variance and its decoder trains on the mean of 3 of the server's own draws."""
    out = tmp_path / "noised"
    config = quick(defense="clip:5+noise:1", rounds=3, record=200, clients=2, train_subset=120)
    run({**config, "noise_key": "a", "out": str(out)}, progress=False)
    records = [load_file(out / "record" / f"round_000{r}.safetensors") for r in (1, 2, 3)]
    assert all(len(r["labels"]) == 120 for r in records)
    found = attack_run(out, {"attack": "inversion", "epochs": 2, "aux": 100})
    averaged = found["averaged"]
    assert averaged["releases"] == 3 and averaged["releases_mean"] == 3.0 and averaged["samples"] == 120
    assert {"ssim", "psnr", "attacker", "decoder", "baseline"} <= set(averaged)


def test_held_out_cut_gradients_are_computed_from_the_labels_as_sent():
    """Without a record, label_leak computes the gradients the server would send: under
    `label_dp:E` from the randomised labels (here E = 0.1: 47.5% flipped), scored against the truth."""
    torch.manual_seed(0)
    server, x, y = torch.nn.Linear(4, 2), torch.randn(8, 4), torch.tensor([0, 1] * 4)
    defense = Defense(label_dp=0.1)
    sent = defense.private_labels(y, 2, torch.Generator().manual_seed(2))  # the attack's seed 0, + 2
    z = x.clone().requires_grad_()
    (expected,) = torch.autograd.grad(torch.nn.functional.cross_entropy(server(z), sent), z)
    assert not torch.equal(sent, y)
    assert torch.equal(cut_gradients(torch.nn.Identity(), server, x, y, defense, 8, 0), expected)
