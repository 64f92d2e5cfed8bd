"""d_chi-privacy on a language model's token embeddings (`defense=dchi:E`): the noise's law, what it
does to the token-inversion attack and to the loss, transports, resume and refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import TINY_GPT, global_weights, straight_and_resumed, train
from splitlab.audit.run import attack_run
from splitlab.cli import main
from splitlab.engine import run
from splitlab.models import build_model, split
from splitlab.privacy.defenses import Defense, dchi_noise


@pytest.mark.parametrize(("epsilon", "d"), [(2.0, 16), (0.5, 64)])
def test_dchi_noise_has_gamma_norms_and_uniform_directions(epsilon, d):
    noise = dchi_noise(torch.zeros(20000, d), epsilon, torch.Generator().manual_seed(0)).double()
    norms = noise.norm(dim=1)
    # the norm is Gamma(d, 1/epsilon): mean d / epsilon, standard deviation sqrt(d) / epsilon
    assert abs(float(norms.mean()) - d / epsilon) < 4 * math.sqrt(d) / epsilon / math.sqrt(len(norms))
    assert float(norms.std()) == pytest.approx(math.sqrt(d) / epsilon, rel=0.05)
    directions = noise / norms[:, None]
    assert float(directions.mean(0).norm()) < 4 * math.sqrt(1 / len(norms))  # no preferred direction


def token_recovery(lm, tmp_path, defense: str) -> tuple[dict, dict]:
    out = tmp_path / defense.replace(":", "_")
    key = {"noise_key": "k"} if defense != "none" else {}
    config = {**lm, "algorithm": "sfl_v2", "cut": 1, "rounds": 2, "record": 20, "defense": defense, **key}
    summary = run({**config, "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=token_inversion", "epochs=20"]) == 0
    return summary, json.loads((out / "attack.json").read_text())["token_inversion"]


def test_dchi_and_noise_on_the_hidden_states_lower_both_token_attacks_at_cut_1(lm, tmp_path):
    """Each defense against the attacks it targets: d_chi noise on the embeddings and Gaussian
    noise on the hidden states at the cut bring the decoder and the nearest-token search down."""
    plain_summary, plain = token_recovery(lm, tmp_path, "none")
    noised_summary, noised = token_recovery(lm, tmp_path, "dchi:1")
    assert plain["decoder"] > plain["baseline"] + 0.5
    assert noised["decoder"] < plain["decoder"] - 0.3
    assert math.isfinite(noised_summary["final_loss"])
    assert noised_summary["privacy"]["epsilon"] is None  # metric DP per token, not an (epsilon, delta)
    assert noised_summary["privacy"]["tokens"]["epsilon_per_token"] == 1.0
    _, at_cut = token_recovery(lm, tmp_path, "noise:0.5")
    assert at_cut["decoder"] < plain["decoder"] - 0.3
    nearest = {d: attack_run(tmp_path / d, {"attack": "embedding_inversion"}) for d in ("none", "dchi_1", "noise_0.5")}
    assert nearest["none"]["accuracy"] > nearest["none"]["baseline"] + 0.5
    assert all(nearest[d]["accuracy"] < nearest["none"]["accuracy"] - 0.3 for d in ("dchi_1", "noise_0.5")), nearest


def test_dchi_noises_the_embeddings_of_a_u_shaped_client_part_before_its_head(lm, tmp_path):
    """U-shaped (cut=1,2), the client's part holds the embedding, the first block and the last
    stages: the noise goes on the embedding output, and only the head runs before the cut."""
    model = build_model("gpt", (16,), 30, **{k: TINY_GPT[k] for k in ("layers", "heads", "width", "context")})
    client, _ = split(model, 1, 2)
    tokens = torch.randint(0, 30, (4, 16), generator=torch.Generator().manual_seed(0))
    found = Defense(dchi=2.0).client_output(client, tokens, torch.Generator().manual_seed(5))
    embed, block, *_ = client.children()
    hidden = embed(tokens)
    assert torch.equal(found, block(hidden + dchi_noise(hidden, 2.0, torch.Generator().manual_seed(5))))
    config = {**lm, "algorithm": "sfl_v2", "cut": "1,2", "rounds": 1, "defense": "dchi:2", "noise_key": "k"}
    summary = run({**config, "out": str(tmp_path / "u")}, progress=False)
    assert math.isfinite(summary["final_loss"]) and "labels" not in summary["comm_bytes_by_kind"]
    assert summary["final_accuracy_deployed"] is not None


def test_dchi_is_bit_identical_through_either_transport_and_resumes(lm):
    config = {**lm, "algorithm": "sfl_v2", "cut": 1, "defense": "dchi:2", "noise_key": "fixed"}
    direct, serialized = train(2, **config), train(2, transport="serialized", **config)
    a, b = global_weights(direct), global_weights(serialized)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert direct.ledger.state_dict() == serialized.ledger.state_dict()
    plain = global_weights(train(2, **{**config, "defense": "none", "noise_key": None}))
    assert not all(torch.equal(a[k], plain[k]) for k in a)
    straight, resumed = straight_and_resumed(3, **config)
    a, b = global_weights(straight), global_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["dataset=synthetic", "defense=dchi:1"], "dchi noises a language model's token embeddings"),
        (["dataset=synthetic", "defense=dchi:0"], "dchi:<epsilon > 0>"),
        (["dataset=synthetic", "defense=dchi:-2"], "dchi:<epsilon > 0>"),
    ],
)
def test_bad_dchi_settings_are_refused_in_one_line(tmp_path, capsys, settings, message):
    code = main(["run", "model=mlp", *settings, f"out={tmp_path / 'x'}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()
