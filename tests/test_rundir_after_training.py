"""Nothing trained is thrown away: a failure once a round has trained removes no file, one after the
last round first checkpoints the trained roles (resume=true finishes the run from them), and a
resumed run may change how it is evaluated (the eval_* keys), not what it trains. Decoding at a
temperature too small to divide by is the greedy choice, not torch's error after training."""

from __future__ import annotations

import errno
import json

import pytest
import torch
import yaml

from helpers import assert_same_run, crash_before_round, fail_once, quick
from splitlab import loop
from splitlab.algorithms.base import Algorithm
from splitlab.cli import main
from splitlab.config import DecodingSettings
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.generation import decode
from splitlab.io import read_jsonl
from splitlab.rundir import CHECKPOINT

ARGS = ["dataset=digits", "model=mlp", "clients=2", "train_subset=200", "device=cpu", "--no-progress"]


#: token t's next-token logits: float32 values a few units apart, as a model's are
LOGITS = torch.tensor([[0.5, 2.0, -1.0, 1.5], [3.0, 0.0, 2.5, 1.0], [-2.0, 1.0, 0.0, 4.0], [1.0, 1.2, 0.9, -3.0]])


@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 5e-324])
@pytest.mark.parametrize("keys", [{}, {"top_k": 2}, {"top_p": 0.5}])
def test_a_temperature_too_small_to_divide_by_samples_the_greedy_choice(temperature, keys):
    """softmax(logits / T) as T -> 0 puts all its mass on the most likely token; where logits / T
    overflows (torch's multinomial raised "probability tensor contains inf / nan") that limit is taken."""
    model = lambda tokens: LOGITS[tokens]  # noqa: E731
    greedy = decode(model, [0], DecodingSettings(max_new_tokens=8), window=4)
    assert greedy == [1, 0] * 4
    for seed in (0, 1):
        tiny = DecodingSettings(max_new_tokens=8, temperature=temperature, seed=seed, **keys)
        assert decode(model, [0], tiny, window=4) == greedy


def test_a_model_whose_scores_are_nan_is_refused_not_decoded_greedily():
    """NaN scores come from weights that are not numbers: no token is chosen from them (argmax of NaN
    is an arbitrary token, a silently wrong generation)."""
    nan = LOGITS.clone()
    nan[1, 2] = torch.nan
    for settings in (DecodingSettings(max_new_tokens=4), DecodingSettings(max_new_tokens=4, temperature=1e-40)):
        with pytest.raises(UserError, match="NaN"):
            decode(lambda tokens: nan[tokens], [0], settings, window=4)


def test_a_failure_after_the_last_round_checkpoints_it_and_resume_finishes_without_training(
    tmp_path, monkeypatch, capsys
):
    """summary.json finds the disk full after the last round (no checkpoint yet: checkpoint_every=60):
    the trained roles are checkpointed, nothing is removed, and resume=true only finishes the run:
    the straight run's files, bit for bit."""
    args = ["run", *ARGS, "rounds=2"]
    assert main([*args, f"out={tmp_path / 'straight'}"]) == 0
    out = tmp_path / "failed"
    full = OSError(errno.ENOSPC, "No space left on device", str(out / "summary.json"))
    with monkeypatch.context() as patch:
        fail_once(patch, loop, "write_json", full, lambda path, *_: path.name == "summary.json")
        assert main([*args, f"out={out}"]) == 1
    err = capsys.readouterr().err
    assert "kept: the checkpoint after the last round, 2" in err and "add resume=true to finish" in err
    assert {"config.yaml", "metrics.jsonl", "weights.safetensors", CHECKPOINT} <= {p.name for p in out.iterdir()}
    with monkeypatch.context() as patch:
        fail_once(patch, Algorithm, "run_round", AssertionError("no round is trained again"))
        assert main([*args, f"out={out}", "resume=true"]) == 0
    assert_same_run(tmp_path / "straight", out)


def test_ctrl_c_after_the_last_round_keeps_it_for_resume_to_finish(tmp_path, monkeypatch, capsys):
    """Ctrl-C while the final files are written (a long eval_generate, say): the trained roles are
    checkpointed before the run stops, and the last line says resume=true finishes it."""
    args = ["run", *ARGS, "rounds=2", f"out={tmp_path / 'run'}"]
    with monkeypatch.context() as patch:
        fail_once(patch, loop, "write_json", KeyboardInterrupt(), lambda path, *_: path.name == "summary.json")
        assert main(args) == 130
    assert "kept: the checkpoint after the last round, 2" in capsys.readouterr().err
    assert main([*args, "resume=true"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds_completed"] == 2


def test_a_failure_once_a_round_has_trained_removes_nothing_and_the_same_command_runs_again(tmp_path, monkeypatch):
    """A bug in round 2, before any checkpoint: round 1's files stay (as after Ctrl-C); the same
    command takes the directory over, as one stopped before its first checkpoint."""
    args = ["run", *ARGS, "rounds=2", f"out={tmp_path / 'run'}"]
    with monkeypatch.context() as patch:
        fail_once(patch, Algorithm, "run_round", RuntimeError("a bug"), lambda self, rnd, clients: rnd == 1)
        with pytest.raises(RuntimeError, match="a bug"):
            main(args)
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 1 and (tmp_path / "run" / "config.yaml").exists()
    assert main(args) == 0


def test_resume_may_change_the_evaluation_keys_and_records_them_not_the_training_keys(tmp_path, monkeypatch):
    config = quick(algorithm="sfl_v2", rounds=4, checkpoint_every=0, out=str(tmp_path / "run"))
    crash_before_round(1, config, monkeypatch)
    with pytest.raises(UserError, match=r"cannot resume .*: lr=0.5 differs from the stored"):
        run({**config, "resume": True, "lr": 0.5}, progress=False)
    assert run({**config, "resume": True, "eval_every": 2}, progress=False)["rounds_completed"] == 4
    assert [row["round"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 4]
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["eval_every"] == 2
