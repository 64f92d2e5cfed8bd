"""Training as a Trainer + peft user expects: whole-model clipping across the cut (clip_scope=global),
per-step warm-up and decay (each role counting its own steps), the per-step log (log_every), a
client optimizer kept across rounds, and adapter checkpoints every N steps (save_every, keep_best)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import (
    TINY_GPT,
    crash_before_round,
    global_weights,
    max_abs_difference,
    quick,
    straight_and_resumed,
    train,
)
from splitlab.config import RunConfig
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.io import read_jsonl
from splitlab.roles import Blueprint
from splitlab.schedules import step_factor, warmup_length


def test_global_clipping_makes_one_client_sfl_v2_centralized_training(lm):
    """max_grad_norm as the Trainer means it: the norm of the whole model, client and server parts."""
    config = dict(lm, clients=1, rounds=1, local_steps=4, optimizer="adamw", max_grad_norm=1.0)
    centralized = global_weights(train(1, algorithm="centralized", **config))
    per_part = global_weights(train(1, algorithm="sfl_v2", **config))
    whole = train(1, algorithm="sfl_v2", clip_scope="global", **config)
    assert max_abs_difference(per_part, centralized) > 1e-4  # clipping each part on its own is another step
    assert max_abs_difference(global_weights(whole), centralized) <= 1e-5
    kinds = whole.ledger.state_dict()  # one float32 norm each way per step
    assert kinds["grad_norm_down"] == kinds["grad_norm_up"] == 4 * 4


def test_global_clipping_is_the_same_through_bytes_and_after_a_resume():
    config = quick(algorithm="sfl_v2", clip_scope="global", max_grad_norm=0.1, optimizer="adamw", participation=0.7)
    direct = train(2, **config)
    serialized = train(2, transport="serialized", **config)
    assert max_abs_difference(global_weights(serialized), global_weights(direct)) == 0
    assert serialized.ledger.state_dict() == direct.ledger.state_dict()
    straight, resumed = straight_and_resumed(3, **config)
    assert max_abs_difference(global_weights(resumed), global_weights(straight)) == 0


def test_the_trainers_warmup_and_decay_per_step():
    """transformers' get_linear_schedule_with_warmup and ..._cosine_...: 0 at the first step."""
    linear = [0, 0.25, 0.5, 0.75, 1, 5 / 6, 4 / 6, 0.5, 2 / 6, 1 / 6]
    assert [step_factor(s, 10, 4, "linear") for s in range(10)] == pytest.approx(linear, abs=1e-15)
    assert step_factor(7, 10, 4, "cosine") == pytest.approx(0.5)
    assert step_factor(9, 10, 4, "none") == 1.0
    assert warmup_length(0, 0.25, 10) == 3 and warmup_length(5, 0.0, 10) == 5


def test_samples_a_round_trains_on_count_each_epochs_last_short_batch():
    two_epochs = RunConfig(batch_size=32, local_epochs=2)
    assert Blueprint.samples_per_round(two_epochs, 70) == 140  # batches of 32, 32, 6, twice
    assert Blueprint.samples_per_round(two_epochs.model_copy(update={"local_steps": 4}), 70) == 32 + 32 + 6 + 32
    assert Blueprint.samples_per_round(two_epochs, 0) == 0


def test_per_step_warmup_is_logged_as_every_role_steps(tmp_path, monkeypatch):
    """The lr in steps.jsonl at steps 1..N rises linearly, and is the rate each optimizer stepped
    with; one client's split run follows the same schedule in both roles: centralized training."""
    rates: list[float] = []
    step = torch.optim.Adam.step
    monkeypatch.setattr(
        torch.optim.Adam, "step", lambda self, *a: rates.append(self.param_groups[0]["lr"]) or step(self, *a)
    )
    config = quick(clients=1, rounds=2, local_steps=5, lr=0.01, warmup_steps=6, lr_decay="cosine")
    summary = run(dict(config, algorithm="centralized", log_every=1, out=str(tmp_path / "c")), progress=False)
    rows = read_jsonl(tmp_path / "c" / "steps.jsonl")
    assert [row["step"] for row in rows] == list(range(1, 11)) and summary["optimizer_steps"] == 10
    assert [row["lr"] for row in rows[:6]] == pytest.approx([0.01 * s / 6 for s in range(6)])
    assert [row["lr"] for row in rows] == pytest.approx(rates)  # what the optimizer used, step by step
    assert rows[-1]["lr"] == pytest.approx(0.01 * (1 + torch.cos(torch.tensor(torch.pi * 3 / 4)).item()) / 2)
    assert summary["samples_seen"] == 10 * 32 and summary["samples_per_second"] > 0
    config = dict(config, optimizer="sgd", lr=0.1)  # (a client's Adam would start afresh each round)
    centralized = global_weights(train(2, algorithm="centralized", **config))
    split = global_weights(train(2, algorithm="sfl_v2", **config))
    assert max_abs_difference(split, centralized) <= 1e-5


def test_per_step_schedule_resumes_exactly_with_sampled_clients():
    config = quick(algorithm="sfl_v2", participation=0.7, rounds=3, warmup_ratio=0.3, lr_decay="linear")
    straight, resumed = straight_and_resumed(3, **config)
    assert max_abs_difference(global_weights(resumed), global_weights(straight)) == 0
    assert max_abs_difference(global_weights(straight), global_weights(train(3, **quick(algorithm="sfl_v2")))) > 1e-4


def test_a_run_resumed_logs_and_counts_its_steps_as_an_uninterrupted_one(tmp_path, monkeypatch):
    """The loop's step counts, the log's rows and the losses since its last row are checkpointed."""
    config = quick(algorithm="sfl_v2", rounds=3, log_every=4, warmup_ratio=0.2, lr_decay="cosine", checkpoint_every=0)
    whole = run(dict(config, out=str(tmp_path / "whole")), progress=False)
    crash_before_round(2, dict(config, out=str(tmp_path / "cut")), monkeypatch)
    resumed = run(dict(config, out=str(tmp_path / "cut"), resume=True), progress=False)

    def logged(out):
        return [{k: v for k, v in row.items() if k != "samples_per_second"} for row in read_jsonl(out / "steps.jsonl")]

    assert logged(tmp_path / "cut") == logged(tmp_path / "whole") and len(logged(tmp_path / "whole")) == 36 // 4
    assert resumed["optimizer_steps"] == whole["optimizer_steps"] == 36  # 3 clients x 4 batches x 3 rounds
    assert resumed["samples_seen"] == whole["samples_seen"] == 3 * 300


def test_a_kept_client_optimizer_makes_one_client_sfl_v2_centralized_over_rounds():
    """Adam's moments live on across rounds, as the centralized optimizer's; checkpointed with the client."""
    config = quick(clients=1, rounds=2, local_steps=3, optimizer="adam")
    centralized = global_weights(train(2, algorithm="centralized", **config))
    fresh = global_weights(train(2, algorithm="sfl_v2", **config))
    kept = global_weights(train(2, algorithm="sfl_v2", keep_client_optimizer=True, **config))
    assert max_abs_difference(fresh, centralized) > 1e-4
    assert max_abs_difference(kept, centralized) <= 1e-5
    straight, resumed = straight_and_resumed(3, **quick(algorithm="sfl_v1", keep_client_optimizer=True))
    assert max_abs_difference(global_weights(resumed), global_weights(straight)) == 0


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(algorithm="cse_fsl", clip_scope="global", max_grad_norm=1), r"^clip_scope=global does not apply here"),
        (dict(clip_scope="global"), r"clip_scope says how max_grad_norm clips; it needs max_grad_norm=N"),
        (dict(algorithm="psl", keep_client_optimizer=True), r"^keep_client_optimizer does not apply to algorithm=psl"),
        (dict(algorithm="cycle_sfl", warmup_steps=3), r"^warmup_steps, warmup_ratio and lr_decay do not apply"),
        (dict(warmup_steps=3, warmup_ratio=0.1), r"give one"),
        (dict(keep_best="eval_loss"), r"it needs save_every=N"),
        (dict(save_every=2), r"save_every writes the model's Hugging Face folders"),
        (dict(setting="vertical", algorithm="sl", clip_scope="global", max_grad_norm=1), r"clip_scope=global needs"),
    ],
)
def test_step_options_are_refused_in_one_line_where_they_cannot_apply(settings, message):
    with pytest.raises(UserError, match=message):
        train(0, **quick(**settings))


def test_save_every_writes_adapters_peft_loads_and_keep_best_keeps_one(plays, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_helpers import tiny_hf_model

    model_dir = tiny_hf_model(tmp_path / "llama", "llama")
    config = dict(
        dataset="shakespeare_lm", data_dir=plays, model="hf", model_dir=str(model_dir), seq_len=32, lora="4:8",
        algorithm="sfl_v2", clients=1, batch_size=4, local_steps=2, rounds=3, device="cpu", lr=0.01, save_every=3,
    )  # fmt: skip
    out = tmp_path / "run"
    run(dict(config, out=str(out)), progress=False)
    saved = out / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == ["step-4", "step-6"]  # the rounds reaching 3 and 6 steps
    assert not (saved / "step-4" / "hf").exists()  # LoRA: the adapters alone, as peft saves them
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))

    def logits(adapters):
        base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
        with torch.no_grad():
            return PeftModel.from_pretrained(base, adapters).eval()(tokens).logits

    final = logits(out / "peft")
    assert torch.equal(logits(saved / "step-6" / "peft"), final)  # the last round's save is the final model
    assert float((logits(saved / "step-4" / "peft") - final).abs().max()) > 1e-4  # the one before it

    best = tmp_path / "best"
    summary = run(dict(config, keep_best="eval_loss", save_every=2, out=str(best)), progress=False)
    losses = [row["test_loss"] for row in read_jsonl(best / "metrics.jsonl")]
    step = 2 * (1 + losses.index(min(losses)))
    assert [p.name for p in (best / "checkpoints").iterdir()] == [f"step-{step}"]
    assert summary["best_checkpoint"] == str(best / "checkpoints" / f"step-{step}")
    assert summary["best_checkpoint_eval_loss"] == min(losses)
    assert json.loads((best / "checkpoints" / f"step-{step}" / "peft" / "adapter_config.json").read_text())["r"] == 4


def test_a_whole_model_run_saves_hf_folders(lm, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    config = dict(lm, algorithm="sfl_v2", clients=1, rounds=2, local_steps=2, save_every=2, out=str(out))
    summary = run(config, progress=False)
    assert summary["tokens_seen"] == 2 * 2 * 8 * 16 and summary["optimizer_steps"] == 4
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step-2" / "hf", local_files_only=True)
    assert model.config.n_layer == TINY_GPT["layers"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
