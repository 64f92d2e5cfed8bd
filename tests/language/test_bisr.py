"""BiSR (`attack=bisr`): its optimisation recovers by hand what its decoder gets wrong, and on a
tiny split GPT it beats its floor from the hidden states (cut 1) and, U-shaped, from the hidden
states and the tail's gradients together."""

from __future__ import annotations

import json
import shutil

import torch

from splitlab.audit.bisr import bisr
from splitlab.audit.run import attack_run
from splitlab.cli import main
from splitlab.engine import run
from splitlab.models import build_model
from splitlab.privacy.defenses import Defense


def test_the_optimisation_recovers_the_tokens_the_decoder_gets_wrong():
    """An embedding-only client part over 5 tokens of width 8: the 5 embeddings (token plus
    position) are affinely independent, so the one mix of them equal to a received hidden state is
    its token's, and matching it exactly recovers every token; the decoder, trained one epoch on two
    sequences, does not."""
    model = build_model("gpt", (6,), 5, layers=1, heads=1, width=8, context=6, seed=0)
    embedding = torch.nn.Sequential(model[0]).eval()
    generator = torch.Generator().manual_seed(0)
    aux, tokens = torch.randint(0, 5, (2, 6), generator=generator), torch.randint(0, 5, (4, 6), generator=generator)
    with torch.no_grad():
        hidden = embedding(tokens)
    result = bisr(embedding, Defense(), aux, hidden, tokens, 5, epochs=1, steps=100, seed=0)
    assert result["learned"] < 0.6 and result["optimised"] == 1.0 and result["attacker"] == "optimised"
    assert result["accuracy"] == 1.0 and result["baseline"] < 0.5 and not result["gradients"]


def test_bisr_beats_its_floor_at_cut_1_and_u_shaped_with_the_tail_gradients(lm, tmp_path, capsys):
    out = tmp_path / "run"
    run(dict(lm, algorithm="sfl_v2", cut=1, rounds=1, out=str(out)), progress=False)
    sizes = ["aux=19", "targets=10", "epochs=5", "steps=100"]
    assert main(["attack", str(out), "attack=bisr", *sizes]) == 0
    assert "(b) optimised against the hidden states (100 steps)" in capsys.readouterr().out
    found = json.loads((out / "attack.json").read_text())["bisr"]
    assert found["weights"] == "pretrained" and found["samples"] == 10 and not found["gradients"]
    assert found["optimised"] > found["baseline"] and found["accuracy"] >= found["learned"]
    assert len(found["examples"]) == 3 and len(found["examples"][0]["original"]) == 16
    u_shaped = tmp_path / "u"
    run(dict(lm, algorithm="sfl_v2", cut="1,2", rounds=1, record=10, out=str(u_shaped)), progress=False)
    settings = {"attack": "bisr", "aux": 19, "targets": 10, "epochs": 5, "steps": 100}
    found = attack_run(u_shaped, settings)
    assert found["gradients"] and found["targets"] == "recorded round 1" and found["optimised"] > found["baseline"]
    shutil.rmtree(u_shaped / "record")  # the tail gradients the client's final tail would send, for held-out text
    found = attack_run(u_shaped, settings)
    assert found["gradients"] and found["samples"] == 10 and found["optimised"] > found["baseline"]
