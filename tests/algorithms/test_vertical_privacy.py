"""Privacy in vertical runs (setting=vertical): each party's defense at the cut, record=N per party,
the attacks per party (inversion, label_leak) and `splitlab evaluate` on a finished run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import max_abs_difference, straight_and_resumed, train
from splitlab.audit.run import attack_run
from splitlab.cli import main
from splitlab.engine import build, run
from splitlab.errors import UserError
from splitlab.splitgp_evaluation import evaluate_run
from splitlab.transport import Transport

TABLE = dict(setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", device="cpu", seed=0)
DEFENDED = "clip:5+noise:0.3+gradnoise:0.5+topk:0.5+quantize:int8"


def weights(experiment) -> list[torch.Tensor]:
    return [t for state in experiment.algorithm.global_model() for t in state.values()]


@pytest.mark.parametrize(
    "labels", [{}, {"labels_at": 0, "defense": DEFENDED + "+label_dp:1"}], ids=["labels_at_server", "label_dp"]
)
def test_each_partys_defense_changes_what_crosses_bit_identically_through_either_transport_and_resume(labels):
    config = {**dict(TABLE, batch_size=32, local_steps=3, train_subset=100, defense=DEFENDED, noise_key="k"), **labels}
    direct, serialized = train(2, **config), train(2, **config, transport="serialized")
    assert all(torch.equal(a, b) for a, b in zip(weights(direct), weights(serialized), strict=True))
    assert direct.ledger.state_dict() == serialized.ledger.state_dict()
    # 2 rounds x 3 steps x 2 parties x 32 samples, each embedding of 200 floats sent as its top 100:
    # int8 values (100 B), int32 indices (400 B), a float32 scale (4 B); and each batch's shape (2 x int32).
    # The gradients down are compressed alike.
    sent = 2 * 3 * 2 * 32 * (100 + 400 + 4) + 2 * 3 * 2 * 8
    assert direct.ledger.state_dict()["smashed"] == direct.ledger.state_dict()["cut_grad"] == sent
    plain = train(2, **dict(config, defense="none", noise_key=None))
    assert not any(torch.equal(a, b) for a, b in zip(weights(direct), weights(plain), strict=True))
    straight, resumed = straight_and_resumed(2, **config)
    full = [e.full_state(e.algorithm.global_model()) for e in (straight, resumed)]
    assert max_abs_difference(*full) == 0


def test_dp_is_accounted_per_party_and_for_a_whole_row(tmp_path):
    summary = run(
        dict(TABLE, rounds=1, local_steps=2, defense="clip:1+dp:epsilon=2", out=str(tmp_path / "dp")), progress=False
    )
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(2, rel=1e-3) and "each party's" in privacy["per_party"]
    assert privacy["epsilon_all_parties"] > privacy["epsilon"]  # two parties' releases of one row composed


class Networked(Transport):
    """In process, but claiming its parties live elsewhere (the refusal comes before any is reached)."""

    remote = True


def test_record_with_networked_parties_and_other_attacks_are_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="record=5 needs the parties in this process") as error:
        build(dict(TABLE, record=5), Networked)
    assert "\n" not in str(error.value)


def test_record_inversion_and_label_leak_per_party_and_evaluate_on_digits(tmp_path, capsys):
    out = tmp_path / "digits"
    config = dict(TABLE, dataset="digits", cut=1, rounds=1, local_steps=10, batch_size=32, record=64, out=str(out))
    summary = run(config, progress=False)
    recorded = load_file(out / "record" / "round_0001.safetensors")
    assert {k: tuple(v.shape) for k, v in recorded.items()} == {
        **{f"inputs@{j}": (64, 1, 8, 4) for j in (0, 1)},  # each party's half of the image
        **{f"{name}@{j}": (64, 200) for name in ("smashed", "cut_grad") for j in (0, 1)},
        **{f"labels@{j}": (64,) for j in (0, 1)},
    }
    assert torch.equal(recorded["labels@0"], recorded["labels@1"])  # aligned: the same samples at every party
    assert main(["attack", str(out), "attack=inversion", "epochs=5"]) == 0
    inversion = json.loads((out / "attack.json").read_text())["inversion"]
    assert inversion["targets"] == "recorded round 1" and set(inversion["by_party"]) == {"0", "1"}
    for party in inversion["by_party"].values():  # each party's strip is rebuilt well above the mean image
        assert party["attacker"] == "decoder" and party["decoder"]["ssim"] > party["baseline"]["ssim"] + 0.2
    leak = attack_run(out, {"attack": "label_leak"})
    assert set(leak["by_party"]) == {0, 1} and leak["samples"] == 64  # labels at the server: both passive
    assert main(["evaluate", str(out)]) == 0
    assert "party 1: SSIM / PSNR" in capsys.readouterr().out
    assert evaluate_run(out, {})["metrics"]["accuracy"] == summary["final_accuracy"]
    for settings, message in [
        ({"attack": "fsha"}, "attack=fsha is not offered for a vertical run; offered: inversion"),
        ({"attack": "inversion", "round": 2}, "round 2 was not recorded"),
    ]:
        with pytest.raises(UserError, match=message):
            attack_run(out, settings)
    with pytest.raises(UserError, match="rho= does not apply to a vertical run"):
        evaluate_run(out, {"rho": "0.2"})


def test_table_columns_are_inverted_per_party_against_the_mean_row(tmp_path):
    run(dict(TABLE, rounds=1, local_steps=5, out=str(tmp_path / "t")), progress=False)
    result = attack_run(tmp_path / "t", {"attack": "inversion", "epochs": 5, "targets": 50})
    assert [p["columns"] for p in result["by_party"].values()] == [list(range(15)), list(range(15, 30))]
    for party in result["by_party"].values():  # R^2 per column: the mean row scores about 0, the decoder well above
        assert party["baseline"]["r2"] < 0.05 < 0.3 < party["decoder"]["r2"] and len(party["r2_by_column"]) == 15


def test_evaluate_on_a_vertical_run_of_the_parties_own_files_says_what_it_needs_and_where_the_metrics_are(tmp_path):
    import yaml

    config = dict(setting="vertical", algorithm="sl", dataset="csv", model="mlp", labels_at=0, data="own")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(UserError) as error:
        evaluate_run(tmp_path, {})
    message = str(error.value)
    assert message.startswith("evaluate on a vertical run needs every party's columns of the test samples")
    assert "data=own run" in message and "summary.json" in message and "\n" not in message
