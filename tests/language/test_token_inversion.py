"""Token reconstruction from the hidden states at the cut of a GPT (`attack=token_inversion`), and
the image attacks refused on a language run, in one line each."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from splitlab.cli import main
from splitlab.engine import run


def test_a_curious_server_reconstructs_the_tokens_from_the_hidden_states_at_cut_1(lm, tmp_path, capsys):
    out = tmp_path / "gpt"
    run({**lm, "algorithm": "sfl_v2", "cut": 1, "rounds": 2, "record": 20, "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=token_inversion", "epochs=20"]) == 0
    result = json.loads((out / "attack.json").read_text())["token_inversion"]
    record = load_file(out / "record" / "round_0002.safetensors")
    assert result["samples"] == 20 and result["positions"] == 20 * 16 and result["targets"] == "recorded round 2"
    tokens = record["inputs"].long()
    assert result["baseline"] == float((tokens == result["baseline_token"]).float().mean())
    assert result["attacker"] == "decoder" and result["accuracy"] > result["baseline"] + 0.5
    assert [len(e["original"]) for e in result["examples"]] == [16] * 3  # characters: the vocabulary is LEAF's
    capsys.readouterr()
    for attack, message in [
        ("inversion", "it reconstructs images; on a language run use attack=token_inversion"),
        ("label_leak", "labels are its next input tokens"),
        ("model_completion", "labels are its next input tokens"),
    ]:
        assert main(["attack", str(out), f"attack={attack}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"attack={attack} does not apply" in err and message in err
    damaged = {**record, "inputs": record["inputs"] + 0.5}  # not token ids
    save_file(damaged, out / "record" / "round_0002.safetensors")
    assert main(["attack", str(out), "attack=token_inversion"]) == 2
    assert "inputs must be token ids" in capsys.readouterr().err
    save_file({**record, "labels": torch.full_like(record["labels"], -5)}, out / "record" / "round_0002.safetensors")
    assert main(["attack", str(out), "attack=token_inversion"]) == 2
    assert "labels must be 0 to" in capsys.readouterr().err
