"""A finished language run: out/hf loads in transformers with the same logits, `splitlab generate`
prints text from the CLI, `init=RUN_DIR` starts a run where the finished one ended; and the
must-hold equivalences on tiny random Hugging Face GPT-2 and Llama checkpoints with LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_helpers import tiny_hf_model
from splitlab.cli import main
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.loop import evaluate
from splitlab.runmodel import run_model


@pytest.fixture(scope="module")
def finished(plays, tmp_path_factory) -> str:
    """A LoRA SFL-V2 run of a 2-block GPT on the plays, from a centrally pretrained model."""
    folder = tmp_path_factory.mktemp("runs")
    torch.set_num_threads(1)
    common = dict(
        dataset="shakespeare_lm", data_dir=plays, model="gpt", layers=2, heads=2, width=16, context=32, seq_len=16,
        batch_size=8, local_steps=3, device="cpu", rounds=2,
    )  # fmt: skip
    run(dict(common, algorithm="centralized", clients=1, out=str(folder / "pretrained")), progress=False)
    out = folder / "split"
    run(
        dict(common, algorithm="sfl_v2", clients=3, lora="4:8", init=str(folder / "pretrained"), out=str(out)),
        progress=False,
    )
    return str(out)


def test_out_hf_loads_in_transformers_with_the_runs_logits(finished):
    from transformers import AutoModelForCausalLM

    _, model, _, _ = run_model(finished)
    exported = AutoModelForCausalLM.from_pretrained(f"{finished}/hf", local_files_only=True).eval()
    tokens = torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, model(tokens), atol=1e-5)
    summary = json.loads(Path(finished, "summary.json").read_text())
    assert summary["hf_export"].endswith("/hf")


def test_generate_prints_the_prompt_and_its_continuation(finished, capsys):
    assert main(["generate", finished, "prompt=To be", "max_new_tokens=12"]) == 0
    greedy = capsys.readouterr().out.rstrip("\n")
    assert greedy.startswith("To be") and len(greedy) == len("To be") + 12
    assert main(["generate", finished, "prompt=To be", "max_new_tokens=12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == greedy  # greedy is deterministic
    assert main(["generate", finished, "prompt=To be", "max_new_tokens=12", "temperature=1.5"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    assert main(["generate", finished, "prompt=To be €", "max_new_tokens=2"]) == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err


def test_init_starts_from_the_finished_model(finished, tmp_path):
    """A run from `init` evaluates, before training, to what the finished run ended with."""
    from helpers import train

    config = json.loads(json.dumps(run_model(finished)[0].model_dump()))
    config = {k: v for k, v in config.items() if v is not None and k not in ("out", "resume", "overwrite")}
    fresh = train(0, **dict(config, init=finished, lora=None))
    final = json.loads(Path(finished, "metrics.jsonl").read_text().splitlines()[-1])
    assert evaluate(fresh)["loss"] == pytest.approx(final["test_loss"], rel=1e-5)
    with pytest.raises(UserError, match=r"^init=.*: its model does not fit this run's \(size mismatch for "):
        train(0, **dict(config, init=finished, lora=None, width=32))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_hf_checkpoints_with_lora_keep_the_equivalences(arch, plays, tmp_path):
    model_dir = tiny_hf_model(tmp_path / arch, arch)  # 3 blocks
    common = dict(
        dataset="shakespeare_lm", data_dir=plays, model="hf", model_dir=str(model_dir), seq_len=32, lora="4:8",
        batch_size=4, local_steps=2, rounds=2, device="cpu", optimizer="sgd", lr=0.5,
    )  # fmt: skip

    def weights(**config) -> dict[str, torch.Tensor]:
        out = tmp_path / "_".join(f"{v}" for v in config.values())
        run(dict(common, out=str(out), **config), progress=False)
        return load_file(out / "weights.safetensors")

    def same(a: dict, b: dict) -> bool:
        return a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5

    fedavg = weights(algorithm="fedavg", clients=3)
    assert same(weights(algorithm="sfl_v1", clients=3, cut=2), fedavg)
    assert same(weights(algorithm="sfl_v2", clients=1, cut=1), weights(algorithm="centralized", clients=1))
    assert not same(fedavg, load_file(tmp_path / "centralized_1" / "weights.safetensors"))


def test_e2e_trains_an_hf_model_with_the_loss_on_the_references_only(tmp_path):
    import csv

    rows = [(f"name[Place {i}], food[{food}]", f"Place {i} serves {food} food.") for i, food in enumerate("ABCDEFGH")]
    for name in ("trainset.csv", "devset.csv", "testset_w_refs.csv"):
        with (tmp_path / name).open("w", newline="") as file:
            csv.writer(file, quoting=csv.QUOTE_ALL).writerows([("mr", "ref"), *rows])
    model_dir = tiny_hf_model(tmp_path / "gpt2", "gpt2")
    config = dict(
        algorithm="sfl_v2", dataset="e2e", data_dir=str(tmp_path), model="hf", model_dir=str(model_dir), seq_len=48,
        lora="4:8", clients=2, rounds=2, batch_size=4, device="cpu", out=str(tmp_path / "run"), eval_generate=3,
    )  # fmt: skip
    summary = run(config, progress=False)
    assert summary["eval_generate"] == 3 and 0 <= summary["bleu"] <= 100 and 0 <= summary["rouge_l"] <= 1
    generated = [json.loads(line) for line in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert [g["prompt"] for g in generated] == [f"<|endoftext|>{mr} ||" for mr, _ in rows[:3]]  # bos, mr, separator
    assert [g["references"] for g in generated] == [[ref] for _, ref in rows[:3]]
    rows_out = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows_out[-1]["test_loss"] < rows_out[0]["test_loss"] and summary["final_loss"] == rows_out[-1]["test_loss"]
    from helpers import train

    experiment = train(0, **{k: v for k, v in config.items() if k != "out"})
    targets = experiment.data.test_y
    assert (targets == -100).any() and (targets != -100).any()  # the context and the padding are not in the loss
