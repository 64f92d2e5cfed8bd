"""Defenses and attacks on a split GPT over shakespeare_lm: each defense at the cut trains and
changes what is learnt, NoPeek compares token sequences as one-hot encodings, and what would claim
more than it gives (a DP epsilon while the targets travel in the clear, the image attacks) is
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import global_weights, max_abs_difference, train
from splitlab.audit.run import attack_run
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.privacy.defenses import Defense, distance_correlation

DEFENSES = ["clip:0.05", "noise:0.5", "clip:1+noise:0.5", "gradnoise:1", "nopeek:1", "quantize:int8", "topk:0.5"]


def test_each_defense_trains_a_split_gpt_and_changes_what_it_learns(lm):
    config = dict(lm, algorithm="sfl_v2", cut=1, local_steps=1)
    undefended = global_weights(train(1, **config))
    for defense in DEFENSES:
        keys = {"noise_key": "fixed"} if "noise" in defense else {}
        defended = train(1, **config, defense=defense, **keys)
        assert max_abs_difference(global_weights(defended), undefended) > 1e-6, defense


def test_clipping_bounds_each_sequence_and_nopeek_compares_tokens_as_one_hot():
    hidden = torch.randn(4, 16, 8)  # B x T x D: a sequence's activations are one vector
    assert torch.allclose(Defense(clip=0.5).protect(hidden, None).flatten(1).norm(dim=1), torch.full((4,), 0.5))
    tokens = torch.randint(0, 5, (32, 6))
    one_hot = F.one_hot(tokens, 5).flatten(1).float()
    smashed = torch.randn(32, 8)
    assert distance_correlation(tokens, smashed) == pytest.approx(
        distance_correlation(one_hot, smashed).item(), abs=1e-6
    )
    assert distance_correlation(tokens, one_hot) == pytest.approx(1.0, abs=1e-5)


def test_a_dp_target_is_refused_since_the_targets_cross_in_the_clear(lm):
    with pytest.raises(UserError, match=r"defense=clip:1\+dp:epsilon=8: no epsilon holds for shakespeare_lm"):
        train(0, **dict(lm, algorithm="sfl_v2", cut=1, defense="clip:1+dp:epsilon=8"))


def test_clip_and_noise_claim_no_guarantee_and_the_image_attacks_are_refused(lm, tmp_path):
    out = tmp_path / "run"
    run(dict(lm, algorithm="sfl_v2", cut=1, rounds=1, defense="clip:1+noise:0.5", out=str(out)), progress=False)
    privacy = json.loads((out / "summary.json").read_text())["privacy"]
    assert privacy["epsilon"] is None and "the text shifted by one token" in privacy["why"]
    for attack in ("inversion", "label_leak"):
        with pytest.raises(UserError, match=f"attack={attack} does not apply to .*, a language run: ") as error:
            attack_run(out, {"attack": attack})
        assert "\n" not in str(error.value)
