"""Label defenses: Marvell's optimisation and its effect on Li et al.'s attacks, randomised
response's flip rate, refusals, transports and resume."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from helpers import global_weights, idx_bytes, personal_weights, quick, straight_and_resumed, train
from splitlab.audit.run import attack_run
from splitlab.build import client_node
from splitlab.cli import main
from splitlab.config import RunConfig
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.privacy.defenses import (
    KL_SCALE_TOLERANCE,
    Defense,
    MarvellLevel,
    keep_probability,
    marvell_kl_scale,
    marvell_sum_kl,
    marvell_variances,
)


def sum_kl(variances: np.ndarray, u: float, v: float, d: int, g: float) -> float:
    """Marvell's objective, written here from the paper's symmetrised KL of the two Gaussians."""
    neg_dir, neg_iso, pos_dir, pos_iso = variances
    a1, b1, a2, b2 = v + pos_dir, u + neg_dir, v + pos_iso, u + neg_iso
    return (d - 1) * (a2 / b2 + b2 / a2) + (b1 + g) / a1 + (a1 + g) / b1


@pytest.mark.parametrize(
    ("u", "v", "d", "g", "p", "power"),
    [
        (1.0, 2.0, 32, 5.0, 0.3, 5.0),
        (2.0, 0.5, 16, 1.0, 0.1, 4.0),
        (0.1, 0.1, 8, 3.0, 0.5, 0.3),
        (1e-4, 3e-4, 200, 1e-3, 0.2, 1e-3),
    ],
)
def test_marvell_variances_reach_the_constrained_minimum(u, v, d, g, p, power):
    ours = np.array(marvell_variances(u, v, d, g, p, power))
    spent = p * (ours[2] + (d - 1) * ours[3]) + (1 - p) * (ours[0] + (d - 1) * ours[1])
    assert (ours >= 0).all() and spent == pytest.approx(power, rel=1e-9)

    def budget(x: np.ndarray) -> float:
        return power - (p * (x[2] + (d - 1) * x[3]) + (1 - p) * (x[0] + (d - 1) * x[1]))

    feasible = []
    for start in ([power, 0, power, 0], [0, power / d, 0, power / d], [power / (2 * d)] * 4):
        found = minimize(
            lambda x: sum_kl(x, u, v, d, g),
            np.array(start, dtype=float),
            bounds=[(0, None)] * 4,
            constraints=[{"type": "ineq", "fun": budget}],
            method="SLSQP",
            options={"ftol": 1e-14, "maxiter": 1000},
        )
        if budget(found.x) >= -1e-2 * power:  # SLSQP may overspend a little: never to our disadvantage
            feasible.append(found.fun)
    assert sum_kl(ours, u, v, d, g) <= min(feasible) * (1 + 1e-6)


def test_marvell_noise_has_the_class_covariances_it_chose():
    torch.manual_seed(0)
    labels = (torch.arange(4000) % 4 == 0).long()  # p = 1/4
    grad = torch.randn(4000, 6) * 0.1 + labels[:, None] * torch.tensor([1.0, 0, 0, 0, 0, 0])
    noised = Defense(marvell=MarvellLevel(2.0)).send_gradient(grad, torch.Generator().manual_seed(1), labels)
    noise = noised - grad
    flat = grad.double()
    g = float((flat[labels == 1].mean(0) - flat[labels == 0].mean(0)).square().sum())
    u, v = (
        float(flat[labels == 0].var(0, unbiased=False).mean()),
        float(flat[labels == 1].var(0, unbiased=False).mean()),
    )
    neg_dir, neg_iso, pos_dir, pos_iso = marvell_variances(u, v, 6, g, 0.25, 2.0 * g)
    unit = (flat[labels == 1].mean(0) - flat[labels == 0].mean(0)) / math.sqrt(g)
    for cls, along, across in ((1, pos_dir, pos_iso), (0, neg_dir, neg_iso)):
        n = noise[labels == cls].double()
        measured_along = (n @ unit).var()
        measured_across = (n - (n @ unit)[:, None] * unit).square().sum(1).mean() / 5
        assert measured_along == pytest.approx(along, rel=0.1, abs=1e-3)
        assert measured_across == pytest.approx(across, rel=0.1, abs=1e-3)


def gaussian_kl(mean_p: np.ndarray, cov_p: np.ndarray, mean_q: np.ndarray, cov_q: np.ndarray) -> float:
    """KL(N(mean_p, cov_p) || N(mean_q, cov_q)), the closed form for full covariances."""
    inverse_q, diff = np.linalg.inv(cov_q), mean_q - mean_p
    log_det_ratio = np.linalg.slogdet(cov_q)[1] - np.linalg.slogdet(cov_p)[1]
    return 0.5 * (np.trace(inverse_q @ cov_p) + diff @ inverse_q @ diff - len(mean_p) + log_det_ratio)


@pytest.mark.parametrize(
    ("variances", "u", "v", "g"),
    [
        ((0.0, 0.0, 0.0, 0.0), 1.0, 1.0, 1.0),  # N(m, I) against N(0, I), |m|^2 = 1: each KL 1/2, the sum 1
        ((0.3, 0.0, 2.0, 0.5), 0.2, 1.5, 0.7),
        ((4.0, 1.0, 0.1, 0.0), 2.0, 0.5, 3.0),
    ],
)
def test_marvell_sum_kl_is_the_symmetrised_kl_of_the_two_noised_gaussians(variances, u, v, g):
    """The classes as Marvell models them, in 4 dimensions along a rotated direction: positives
    N(sqrt(g) e, v I + Sigma_1), negatives N(0, u I + Sigma_0), Sigma_k = along_k ee^T + across_k (I - ee^T)."""
    d = 4
    e = np.array([1.0, -2.0, 0.5, 2.0])
    e /= np.linalg.norm(e)
    along = np.outer(e, e)
    neg_dir, neg_iso, pos_dir, pos_iso = variances
    cov_pos = v * np.eye(d) + pos_dir * along + pos_iso * (np.eye(d) - along)
    cov_neg = u * np.eye(d) + neg_dir * along + neg_iso * (np.eye(d) - along)
    mean_pos, mean_neg = math.sqrt(g) * e, np.zeros(d)
    direct = gaussian_kl(mean_pos, cov_pos, mean_neg, cov_neg) + gaussian_kl(mean_neg, cov_neg, mean_pos, cov_pos)
    assert marvell_sum_kl(variances, u, v, d, g) == pytest.approx(direct, rel=1e-12)
    if variances == (0.0, 0.0, 0.0, 0.0):
        assert direct == pytest.approx(1.0, rel=1e-12)


def sum_kl_at(scale: float, u: float, v: float, d: int, g: float, p: float) -> float:
    return marvell_sum_kl(marvell_variances(u, v, d, g, p, scale * g), u, v, d, g)


@pytest.mark.parametrize(
    ("u", "v", "d", "g", "p", "bound"),
    [
        (2.9e-8, 1.4e-7, 200, 1e-5, 0.6, 0.25),  # u, v, d of a breast_cancer batch (docs/privacy.md)
        (2.9e-8, 1.4e-7, 200, 1e-5, 0.6, 4.0),
        (1.0, 2.0, 32, 5.0, 0.3, 0.1),
        (2.0, 0.5, 16, 1.0, 0.1, 1.0),
    ],
)
def test_marvell_kl_scale_is_the_smallest_whose_optimum_meets_the_bound(u, v, d, g, p, bound):
    scale = marvell_kl_scale(u, v, d, g, p, bound)
    assert sum_kl_at(scale, u, v, d, g, p) <= bound < sum_kl_at(scale / (1 + KL_SCALE_TOLERANCE), u, v, d, g, p)


def test_marvell_kl_scale_by_hand():
    """Equal class variances w, p = 1/2: the optimum adds the same variance s g along g to both
    classes (none across), so sumKL = g / (w + s g) and the bound K needs s = 1/K - w/g; gradients
    whose sumKL already meets K get no noise."""
    scale = marvell_kl_scale(0.5, 0.5, 8, 2.0, 0.5, 0.25)
    assert 3.75 <= scale <= 3.75 * (1 + KL_SCALE_TOLERANCE)
    assert marvell_kl_scale(1.0, 1.0, 8, 0.1, 0.5, 0.25) == 0.0  # sumKL 0.1 unperturbed


def test_marvell_with_a_kl_bound_is_marvell_at_the_scale_it_finds():
    torch.manual_seed(0)
    labels = (torch.arange(64) % 3 == 0).long()
    grad = torch.randn(64, 10) * 0.1 + labels[:, None] * 0.3
    flat, positive = grad.double(), labels == 1
    u, v = float(flat[~positive].var(0, unbiased=False).mean()), float(flat[positive].var(0, unbiased=False).mean())
    g = float((flat[positive].mean(0) - flat[~positive].mean(0)).square().sum())
    scale = marvell_kl_scale(u, v, 10, g, float(positive.double().mean()), 0.25)
    bounded = Defense(marvell=MarvellLevel(0.25, kl=True)).send_gradient(grad, torch.Generator().manual_seed(1), labels)
    fixed = Defense(marvell=MarvellLevel(scale)).send_gradient(grad, torch.Generator().manual_seed(1), labels)
    assert scale > 1 and torch.equal(bounded, fixed)


BINARY = dict(dataset="breast_cancer", model="mlp", algorithm="sl", clients=2, rounds=5, record=200, device="cpu")

#: Noise keys a defended claim is checked over. One run's AUC is a draw, and which draw a key gives
#: depends on the machine (MKL picks its kernels by CPU: Marvell's linear algebra differs in its
#: last bits and training takes another path): at `marvell:16` single runs scatter around 0.5 with
#: a standard deviation of about 0.06 (docs/privacy.md, 9 runs on each of two machines), so one
#: run misses 0.5 +- 0.1 now and then. The mean over six keys has a standard error of about 0.026:
#: "within 0.1 of chance" holds with a margin of nearly four of them wherever the defense works.
KEYS = ("a", "b", "c", "d", "e", "f")


def recorded_leak(tmp_path, defense: str, key: str | None = None) -> tuple[dict, dict]:
    """A vanilla split run on breast cancer (binary) and Li et al.'s attacks through `splitlab attack`."""
    out = tmp_path / f"{defense.replace(':', '_')}_{key}"
    summary = run({**BINARY, "defense": defense, "noise_key": key, "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=label_leak"]) == 0
    return summary, json.loads((out / "attack.json").read_text())["label_leak"]


def mean_over_keys(tmp_path, defense: str) -> tuple[float, dict[str, float]]:
    """(the lowest final accuracy, the mean of each AUC) over KEYS."""
    found = [recorded_leak(tmp_path, defense, key) for key in KEYS]
    mean = {name: float(np.mean([leak[name] for _, leak in found])) for name in ("norm_auc", "direction_auc")}
    for name in ("direction", "residual"):
        mean[f"per_batch_{name}_median"] = float(
            np.mean([leak["per_batch"][f"{name}_auc_median"] for _, leak in found])
        )
    return min(summary["final_accuracy"] for summary, _ in found), mean


@pytest.fixture(scope="module")
def undefended(tmp_path_factory) -> tuple[dict, dict]:
    return recorded_leak(tmp_path_factory.mktemp("undefended"), "none")


def test_marvell_brings_li_et_al_attacks_to_chance_but_not_the_residual_attack(tmp_path, undefended):
    """Li et al.'s norm and direction attacks are at chance under Marvell; the residual attack,
    which reads where the gradients depart from Marvell's Gaussian model, is not (docs/privacy.md:
    per-batch medians 0.96-1.00 on every key measured)."""
    plain_summary, plain = undefended
    accuracy, marvell = mean_over_keys(tmp_path, "marvell")
    assert plain["direction_auc"] > 0.95  # the leak is there undefended
    assert abs(marvell["norm_auc"] - 0.5) < 0.1 and abs(marvell["direction_auc"] - 0.5) < 0.1, marvell
    # per batch, the paper's figure: 5 rounds x 3 whole batches of 64 (record=200 cuts the 4th short)
    assert plain["per_batch"]["batches"] == 15 and plain["per_batch"]["direction_auc_median"] == 1.0
    assert marvell["per_batch_direction_median"] < 0.7, marvell
    assert marvell["per_batch_residual_median"] >= 0.9 and plain["per_batch"]["residual_auc_median"] < 0.7, marvell
    assert accuracy > plain_summary["final_accuracy"] - 0.05


def test_marvell_at_the_reference_codes_kl_bound_takes_the_direction_attack_near_chance(tmp_path, undefended):
    """`marvell:kl=0.25`, the reference code's default bound on the symmetrised KL, picks a scale
    per batch (about 1/K, docs/privacy.md): the direction attack no longer reads the labels and
    the norm attack is near chance on average, but single runs miss 0.5 +- 0.1 in about half the
    benchmark's runs (5 of 9 on each machine measured), in one attack or the other, so the issue's
    claim is checked at the default (above), not at this bound."""
    plain_summary, plain = undefended
    accuracy, bounded = mean_over_keys(tmp_path, "marvell:kl=0.25")
    assert plain["direction_auc"] > 0.95 and bounded["direction_auc"] < 0.7, bounded
    assert abs(bounded["norm_auc"] - 0.5) < 0.15, bounded
    assert accuracy > plain_summary["final_accuracy"] - 0.05


def test_marvell_on_a_vertical_run_protects_the_labels_from_every_passive_party(tmp_path):
    """Li et al.'s own setting: the party without labels receives the cut gradients. The server
    holds the labels (labels_at=server) and noises each party's gradient with Marvell."""
    vertical = {**BINARY, "setting": "vertical", "parties": 2, "clients": RunConfig.model_fields["clients"].default}
    found = {}
    for defense, key in (("none", None), *(("marvell", key) for key in KEYS)):
        out = tmp_path / f"{defense}_{key}"
        run({**vertical, "defense": defense, "noise_key": key, "out": str(out)}, progress=False)
        found[defense, key] = attack_run(out, {"attack": "label_leak"})["by_party"]
    assert all(party["direction_auc"] > 0.95 for party in found["none", None].values())
    for party in found["none", None]:  # the norm attack: below 0.5 here, Marvell's reversal (docs/privacy.md)
        mean = np.mean([found["marvell", key][party]["direction_auc"] for key in KEYS])
        assert abs(mean - 0.5) < 0.1, (party, found)


def test_label_dp_at_a_labelled_vertical_party_flips_at_its_rate_and_records_the_truth(tmp_path, monkeypatch):
    """labels_at=0: the label holder randomises the labels it sends with each step's embedding. The
    server trains on them, flipped at randomised response's rate; the record keeps the truth (the
    attacks are scored on it): the same labels as an undefended run's on the same rows."""
    from safetensors.torch import load_file

    from splitlab.algorithms.vertical_sl import LabelParty
    from splitlab.privacy.record import round_file

    vertical = {**BINARY, "setting": "vertical", "parties": 2, "labels_at": 0, "rounds": 2, "record": 100}
    vertical["clients"] = RunConfig.model_fields["clients"].default
    sent, true = [], []
    released = LabelParty._released

    def observed(self, step):
        message = released(self, step)
        sent.append(message["labels"])
        true.append(self.batch_labels(self.rows(step)))
        return message

    monkeypatch.setattr(LabelParty, "_released", observed)
    summary = run({**vertical, "defense": "label_dp:1", "noise_key": "k", "out": str(tmp_path / "dp")}, progress=False)
    monkeypatch.undo()
    sent_labels, true_labels = torch.cat(sent), torch.cat(true)
    flip = 1 - math.exp(1) / (math.exp(1) + 1)
    tolerance = 4 * math.sqrt(flip * (1 - flip) / len(true_labels))
    assert len(true_labels) > 800 and abs(float((sent_labels != true_labels).double().mean()) - flip) < tolerance
    assert summary["privacy"]["labels"]["epsilon_per_label"] == 2.0  # 2 rounds, composed
    run({**vertical, "out": str(tmp_path / "plain")}, progress=False)
    defended, plain = (load_file(round_file(tmp_path / name, 2)) for name in ("dp", "plain"))  # the last round's
    assert torch.equal(defended["labels@0"], plain["labels@0"]) and torch.equal(defended["labels@1"], plain["labels@0"])
    assert not torch.equal(defended["smashed@0"], plain["smashed@0"])  # the same rows, through other weights


def test_marvell_is_refused_on_a_client_whose_own_data_is_not_binary(tmp_path):
    """data=own: the task is known once the client reads its files, and checked there."""
    folder = tmp_path / "own"
    folder.mkdir()
    labels = np.arange(20) % 10
    (folder / "train-images-idx3-ubyte").write_bytes(idx_bytes(np.zeros((20, 28, 28), dtype=np.uint8)))
    (folder / "train-labels-idx1-ubyte").write_bytes(idx_bytes(labels.astype(np.uint8)))
    config = dict(dataset="fashion_mnist", model="mlp", clients=2, data="own", data_dir=str(folder), defense="marvell")
    with pytest.raises(UserError, match="marvell needs a binary classification task; fashion_mnist has 10 classes"):
        client_node(config, 0)


@pytest.mark.parametrize(("epsilon", "classes"), [(0.5, 2), (1.0, 10), (3.0, 4)])
def test_randomised_response_flips_at_its_epsilon_rate(epsilon, classes):
    labels = torch.arange(20000) % classes
    sent = Defense(label_dp=epsilon).private_labels(labels, classes, torch.Generator().manual_seed(0))
    flip = 1 - math.exp(epsilon) / (math.exp(epsilon) + classes - 1)  # written from the definition
    assert keep_probability(epsilon, classes) == pytest.approx(1 - flip, rel=1e-12)
    tolerance = 4 * math.sqrt(flip * (1 - flip) / len(labels))  # four binomial standard deviations
    assert abs(float((sent != labels).double().mean()) - flip) < tolerance
    flipped = sent[sent != labels] - labels[sent != labels]
    counts = torch.bincount(flipped % classes, minlength=classes)[1:]  # every other class alike
    assert counts.min() > 0.8 * counts.float().mean() and sent.dtype == labels.dtype and sent.shape == labels.shape


def test_label_dp_changes_only_the_labels_sent_and_states_its_epsilon(tmp_path):
    out = tmp_path / "r"
    summary = run(
        {**quick(algorithm="sfl_v2", record=50), "defense": "label_dp:1", "noise_key": "k", "out": str(out)},
        progress=False,
    )
    labels = summary["privacy"]["labels"]
    assert labels["epsilon_per_release"] == 1.0 and labels["delta"] == 0.0
    assert labels["epsilon_per_label"] == 2.0 and summary["privacy"]["epsilon"] is None  # 2 rounds, composed
    plain = train(1, **quick(algorithm="sfl_v2"))
    private = train(1, **quick(algorithm="sfl_v2", defense="label_dp:1", noise_key="k"))
    assert plain.ledger.state_dict() == private.ledger.state_dict()  # the same bytes: labels stay int64
    a, b = global_weights(plain), global_weights(private)
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the server trained on other labels


@pytest.mark.parametrize("algorithm", ["sfl_v2", "cycle_sfl", "sglr"])
def test_label_defenses_are_bit_identical_through_either_transport(algorithm):
    for config in (
        quick(algorithm=algorithm, defense="label_dp:1", noise_key="fixed"),
        {**quick(algorithm=algorithm, defense="marvell+gradnoise:0.5", noise_key="fixed"), **BINARY_QUICK},
    ):
        direct = train(2, **config)
        serialized = train(2, transport="serialized", **config)
        if direct.algorithm.personal_models:
            a, b = personal_weights(direct), personal_weights(serialized)
            assert a.keys() == b.keys() and all(torch.equal(a[i][k], b[i][k]) for i in a for k in a[i])
        else:
            a, b = global_weights(direct), global_weights(serialized)
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert direct.ledger.state_dict() == serialized.ledger.state_dict()


BINARY_QUICK = dict(dataset="breast_cancer", train_subset=None)


@pytest.mark.parametrize("defense", ["label_dp:2", "marvell:2"])
def test_a_label_defended_run_resumes_bit_for_bit(defense):
    config = {**quick(algorithm="sfl_v2", defense=defense, noise_key="fixed"), **BINARY_QUICK}
    straight, resumed = straight_and_resumed(3, **config)
    a, b = global_weights(straight), global_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["dataset=synthetic", "defense=label_dp:0"], "label_dp:<epsilon > 0>"),
        (["dataset=synthetic", "defense=label_dp:-1"], "label_dp:<epsilon > 0>"),
        (["dataset=synthetic", "defense=marvell:0"], "marvell[:<power scale > 0>]"),
        (
            ["dataset=breast_cancer", "defense=marvell:kl=0"],
            "invalid defense 'marvell:kl=0': expected marvell[:<power scale > 0>] or marvell:kl=<sumKL bound > 0>",
        ),
        (["dataset=breast_cancer", "defense=marvell:kl=x"], "invalid defense 'marvell:kl=x': expected marvell["),
        (["dataset=breast_cancer", "defense=marvell:kl=inf"], "marvell:kl=<sumKL bound > 0>"),
        (
            ["dataset=synthetic", "defense=marvell"],
            "marvell needs a binary classification task; synthetic has 10 classes",
        ),
        (["dataset=breast_cancer", "defense=marvell", "cut=1,2"], "in a U-shaped split"),
        (["dataset=synthetic", "defense=label_dp:1", "cut=1,2"], "in a U-shaped split"),
        (
            ["dataset=breast_cancer", "defense=label_dp:1", "setting=vertical"],
            "with labels_at=server they never leave the server: give labels_at=<the party holding them>",
        ),
        (
            ["dataset=digits", "defense=marvell", "setting=vertical", "algorithm=sl"],
            "marvell needs a binary classification task",
        ),
    ],
)
def test_bad_label_defenses_are_refused_in_one_line(tmp_path, capsys, settings, message):
    code = main(["run", "model=mlp", *settings, f"out={tmp_path / 'x'}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()
