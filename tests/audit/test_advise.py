"""`splitlab advise`: hand-computed costs per cut, and the table, JSON and plot of a tiny probe."""

from __future__ import annotations

import json

from splitlab.audit.advise import COLUMNS, cut_costs, markdown, recommend, strongest_label_auc, trade_offs
from splitlab.audit.probes import pareto_front
from splitlab.audit.settings import AdviseSettings
from splitlab.cli import main


def test_costs_per_cut_are_the_hand_computed_ones():
    # mlp on 1x8x8 inputs: fc1 = Linear(64, 200), fc2 = Linear(200, 200); 200 activations at either cut
    plain, int8 = (cut_costs(AdviseSettings(model="mlp", defense=d), (1, 8, 8), 10) for d in ("none", "quantize:int8"))
    assert [row["client_parameters"] for row in plain] == [64 * 200 + 200, 64 * 200 + 200 + 200 * 200 + 200]
    assert [row["client_flops"] for row in plain] == [2 * 64 * 200, 2 * 64 * 200 + 2 * 200 * 200]
    assert [(row["up_bytes"], row["down_bytes"]) for row in plain] == [(200 * 4 + 8, 200 * 4)] * 2
    assert [(row["up_bytes"], row["down_bytes"]) for row in int8] == [(200 + 4 + 8, 200 + 4)] * 2


def test_advise_writes_a_table_a_json_and_a_plot(tmp_path, capsys):
    out = tmp_path / "advise"
    args = ["dataset=synthetic", "model=mlp", "rounds=1", "clients=2", "train_subset=200", "test_subset=200"]
    assert main(["advise", *args, "aux=60", "targets=40", "epochs=1", f"out={out}"]) == 0
    rows = json.loads((out / "advise.json").read_text())["rows"]
    assert [row["cut"] for row in rows] == [1, 2]
    assert all(0 <= row["direction_auc"] <= 1 and 0 <= row["accuracy"] <= 1 for row in rows)
    assert (out / "advise.md").read_text().count("\n| ") == 3 and (out / "advise.png").is_file()
    assert "| 2 | 53,200 |" in capsys.readouterr().out
    assert main(["advise", "model=nope", f"out={tmp_path / 'x'}"]) == 2


def test_advise_on_digits_with_default_sizes_says_what_it_used(tmp_path):
    """digits has 1,437 training and 360 test samples: the default sizes (2000, 1500, aux 1000,
    targets 300) become what fits, and the table says so."""
    out = tmp_path / "advise"
    assert main(["advise", "dataset=digits", "rounds=1", "clients=2", "epochs=1", f"out={out}"]) == 0
    result = json.loads((out / "advise.json").read_text())
    assert result["sizes"] == {"train_subset": 1437, "test_subset": 360, "targets": 180, "aux": 180}
    table = (out / "advise.md").read_text()
    assert "train_subset=1437, test_subset=360" in table and "aux=180 samples, targets=180" in table
    assert "floor SSIM" in table and "Pareto front" in table and f"pick cut {result['pick']}" in table
    assert all(row["ssim"] >= row["floor_ssim"] for row in result["rows"])


def test_advise_refuses_before_training(tmp_path, capsys):
    for bad in (["algorithm=fedavg"], ["dataset=digits", "aux=300", "targets=100"], ["max_ssim=2"]):
        assert main(["advise", *bad, f"out={tmp_path / 'x'}"]) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def row(cut, accuracy, ssim, auc, up):
    return {"cut": cut, "accuracy": accuracy, "ssim": ssim, "norm_auc": auc, "direction_auc": auc, "label_auc": auc} | {
        "up_bytes": up
    }


def test_the_pick_is_the_most_accurate_front_cut_within_the_budgets():
    rows = [row(1, 0.9, 0.8, 0.9, 100), row(2, 0.8, 0.5, 0.8, 50), row(3, 0.7, 0.6, 0.95, 200)]
    assert pareto_front(rows, trade_offs) == [1, 2]  # cut 3 is worse than cut 2 on everything
    assert recommend(AdviseSettings(), rows) == {"pareto_front": [1, 2], "pick": 1, "unranked": []}
    assert recommend(AdviseSettings(max_ssim=0.6), rows)["pick"] == 2
    assert recommend(AdviseSettings(max_ssim=0.6, max_auc=0.7), rows)["pick"] is None


def test_probes_at_their_floor_are_not_ranked_and_none_is_called_the_most_accurate():
    """Probes whose accuracy sits at the most frequent class's share measure an untrained model: they
    are on neither the front nor the pick, and the table says so instead of 'the most accurate'."""
    at_chance = [row(1, 0.105, 0.8, 0.5, 100) | {"ranked": False}, row(2, 0.1, 0.5, 0.5, 50) | {"ranked": False}]
    advice = recommend(AdviseSettings(), at_chance)
    assert advice == {"pareto_front": [], "pick": None, "unranked": [1, 2]}
    sizes = {"train_subset": 10, "test_subset": 10, "aux": 5, "targets": 5}
    cells = {key: 0 for key, _, _ in COLUMNS}
    text = markdown(AdviseSettings(), sizes, [cells | r for r in at_chance], advice)
    assert "no probe trained enough to rank" in text and "most accurate" not in text
    one_trained = [at_chance[0], row(2, 0.6, 0.5, 0.5, 50) | {"ranked": True}]
    advice = recommend(AdviseSettings(), one_trained)
    assert advice["pick"] == 2 and advice["unranked"] == [1]
    text = markdown(AdviseSettings(), sizes, [cells | r for r in one_trained], advice)
    assert "pick cut 2 (the most accurate of those trained enough to rank)" in text


def test_the_label_figure_weighed_is_the_strongest_label_attack():
    leak = {"norm_auc": 0.5, "direction_auc": 0.55, "residual_auc": 0.97, "gradient": "cut", "linked": {"auc": 0.9}}
    assert strongest_label_auc(leak) == 0.97
    assert strongest_label_auc({"norm_auc": 0.5, "direction_auc": 0.6, "linked": {"auc": 0.8}}) == 0.8


def test_advise_refuses_bad_settings_before_any_training(tmp_path, capsys):
    probe = ["dataset=synthetic", "model=mlp", "rounds=1", "clients=2", "train_subset=200", f"out={tmp_path / 'a'}"]
    for args, message in [
        (["algorithm=fedavg"], "algorithm=fedavg has none"),
        (["test_subset=50", "aux=40", "targets=20"], "ask for fewer"),
        (["lr=nan"], "invalid value nan for lr"),
        (["batch_size=true"], "invalid value 'true' for batch_size"),
        (["defense=blur"], "defense"),
    ]:
        assert main(["advise", *probe, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "a").exists()
