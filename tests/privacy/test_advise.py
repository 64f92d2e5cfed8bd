"""`splitlab advise`: hand-computed costs per cut, and the table, JSON and plot of a tiny probe."""

from __future__ import annotations

import json

from splitlab.cli import main
from splitlab.privacy.advise import AdviseSettings, cut_costs


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


def test_advise_refuses_bad_settings_before_any_training(tmp_path, capsys):
    probe = ["dataset=synthetic", "model=mlp", "rounds=1", "clients=2", "train_subset=200", f"out={tmp_path / 'a'}"]
    for args, message in [
        (["algorithm=fedavg"], "algorithm=fedavg does not split the model"),
        (["test_subset=50"], "raise test_subset or lower aux/targets"),
        (["lr=.nan"], "expected a finite number"),
        (["batch_size=true"], "not a boolean"),
        (["defense=blur"], "defense"),
    ]:
        assert main(["advise", *probe, *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "a").exists()
