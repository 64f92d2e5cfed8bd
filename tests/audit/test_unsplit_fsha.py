"""The data-oblivious inversion (UnSplit) and the malicious server (FSHA) against SplitGuard, on a
real tiny run: what each recovers against the floors, and the `attack` command's one-line refusals."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from splitlab.audit.common import image_scores
from splitlab.audit.fsha import splitguard_score
from splitlab.audit.unsplit import surrogate_of, total_variation
from splitlab.cli import main
from splitlab.engine import run


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """Two rounds of SplitFed-v2 on digits at cut 1, undefended, the last 50 samples recorded."""
    out = tmp_path_factory.mktemp("unsplit") / "run"
    config = dict(dataset="digits", model="cnn", cut=1, clients=2, rounds=2, record=50, device="cpu", seed=0)
    run({**config, "out": str(out)}, progress=False)
    return out


def test_unsplit_reconstructs_the_recorded_inputs_without_data_or_weights(digits_run, capsys):
    assert main(["attack", str(digits_run), "attack=unsplit", "iterations=15"]) == 0
    result = json.loads((digits_run / "attack.json").read_text())["unsplit"]
    inputs = load_file(digits_run / "record" / "round_0002.safetensors")["inputs"]
    span = float(inputs.max() - inputs.min())
    random_image = image_scores(torch.rand(inputs.shape, generator=torch.Generator().manual_seed(0)), inputs, span)
    assert result["samples"] == 50 and result["targets"] == "recorded round 2"
    assert result["ssim"] > result["baseline"]["ssim"] + 0.15  # better than knowing the average digit
    assert result["ssim"] > random_image["ssim"] + 0.4 and result["psnr"] > result["baseline"]["psnr"]
    assert (digits_run / "attack_unsplit.png").is_file()
    assert "floor: mean image" in capsys.readouterr().out


def test_fsha_hijacks_the_client_and_splitguard_tells_the_servers_apart(digits_run):
    assert main(["attack", str(digits_run), "attack=fsha", "steps=100", "aux=200", "targets=160"]) == 0
    result = json.loads((digits_run / "attack.json").read_text())["fsha"]
    malicious, honest = result["malicious"], result["honest"]
    ssims = [row["ssim"] for row in malicious["by_step"].values()]
    assert list(malicious["by_step"]) == ["20", "40", "60", "80", "100"]
    assert ssims[-1] > ssims[0] and ssims[-1] > malicious["baseline"]["ssim"] + 0.1  # the decoder inverts the client
    assert honest["splitguard"] > 0.9 > 0.5 > malicious["splitguard"]
    assert 0 <= malicious["task_accuracy"] <= 1 and honest["task_accuracy"] > 0.5
    assert (digits_run / "attack_fsha.png").is_file()


def test_bad_options_get_one_line(digits_run, capsys):
    capsys.readouterr()
    for args, message in [
        (["attack=unsplit", "iterations=0"], "invalid value 0 for iterations"),
        (["attack=unsplit", "tv=-1"], "invalid value -1 for tv"),
        (["attack=fsha", "steps=10", "guard=9"], "guard=9 leaves SplitGuard no fake batch"),
        (["attack=fsha", "steps=5"], "invalid value 5 for steps"),
        (["attack=fsha", "aux=400"], "aux=400 and targets=180 need 580 test samples"),
    ]:
        assert main(["attack", str(digits_run), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_splitguard_score_on_planted_gradients():
    torch.manual_seed(0)
    regular = [torch.ones(8) + 0.1 * torch.randn(8) for _ in range(20)]
    flipped = [-3 * torch.ones(8) + 0.1 * torch.randn(8) for _ in range(4)]  # larger, opposite: labels matter
    alike = [torch.ones(8) + 0.1 * torch.randn(8) for _ in range(4)]  # labels ignored
    assert splitguard_score(flipped, regular, 0) > 0.99
    assert splitguard_score(alike, regular, 0) < 0.3  # sigmoid(0)^2 = 0.25 when nothing differs


def test_total_variation_and_the_surrogates_fresh_weights():
    image = torch.tensor([[[[0.0, 1.0], [3.0, 1.0]]]])
    assert float(total_variation(image)) == pytest.approx((3 + 0) / 2 + (1 + 2) / 2)
    client = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 5))
    surrogate = surrogate_of(client, 0)
    assert all(not torch.equal(a, b) for a, b in zip(client.parameters(), surrogate.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(surrogate.parameters(), surrogate_of(client, 0).parameters()))

    class Scale(nn.Module):  # a layer with weights and no way to redraw them
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(1))

    with pytest.raises(ValueError, match="cannot draw fresh weights"):
        surrogate_of(nn.Sequential(Scale()), 0)
