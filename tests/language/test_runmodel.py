"""A finished language run: out/hf loads in transformers with the same logits, `splitlab generate`
prints text from the CLI, `init=RUN_DIR` starts a run where the finished one ended; and the
must-hold equivalences on tiny random Hugging Face GPT-2 and Llama checkpoints with LoRA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_helpers import tiny_hf_model
from splitlab.cli import main
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.loop import evaluate
from splitlab.resolve import resolve_config
from splitlab.run_weights import run_model
from splitlab.rundir import stored_config


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


def test_out_peft_of_a_model_gpt_run_adapts_the_export_of_the_run_it_started_from(finished):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter_config = json.loads(Path(finished, "peft", "adapter_config.json").read_text())
    base = adapter_config["base_model_name_or_path"]
    assert base == str(Path(finished).parent.resolve() / "pretrained" / "hf")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), f"{finished}/peft").eval()
    exported = AutoModelForCausalLM.from_pretrained(f"{finished}/hf", local_files_only=True).eval()
    tokens = torch.randint(0, 80, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((adapted(tokens).logits - exported(tokens).logits).abs().max()) <= 1e-5


def test_exported_folders_open_like_any_other_and_the_tokenizer_knows_its_ends(finished):
    """Folders 0755 and files 0644 under umask 022 (mkdtemp's 0700 is not kept); the character
    tokenizer ends and pads with the vocabulary's first symbol and is as long as the context."""
    import os

    from transformers import AutoTokenizer

    umask = os.umask(0)
    os.umask(umask)
    for folder in ("hf", "peft"):
        path = Path(finished, folder)
        assert path.stat().st_mode & 0o777 == 0o777 & ~umask
        assert {p.stat().st_mode & 0o777 for p in path.iterdir()} == {0o666 & ~umask}
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.model_max_length) == ("\n", "\n", 32)


def test_config_yaml_records_model_gpts_sizes_as_used():
    from splitlab.resolve import resolve_config

    config = resolve_config(dict(model="gpt", dataset="shakespeare_lm", layers=2))
    assert {k: config.as_dict()[k] for k in ("layers", "heads", "width", "context")} == dict(
        layers=2, heads=4, width=128, context=256
    )


def test_generate_prints_the_prompt_and_its_continuation(finished, capsys):
    assert main(["generate", finished, "prompt=To be", "max_new_tokens=12"]) == 0
    greedy = capsys.readouterr().out.rstrip("\n")
    assert greedy.startswith("To be") and len(greedy) == len("To be") + 12
    assert main(["generate", finished, "prompt=To be", "max_new_tokens=12"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == greedy  # greedy is deterministic
    assert main(["generate", finished, "prompt=To be", "max_new_tokens=12", "temperature=1.5"]) == 0
    assert capsys.readouterr().out.startswith("To be")
    for prompt in ("ROMEO:", "yes", "null", "1e3"):  # text that YAML would read as something else
        assert main(["generate", finished, f"prompt={prompt}", "max_new_tokens=2"]) == 0
        assert capsys.readouterr().out.rstrip("\n")[: len(prompt)] == prompt
    assert main(["generate", finished, "prompt=To be €", "max_new_tokens=2"]) == 2
    assert "outside the model's vocabulary" in capsys.readouterr().err


def test_init_starts_from_the_finished_model(finished, tmp_path):
    """A run from `init` evaluates, before training, to what the finished run ended with."""
    from helpers import train

    config = resolve_config(stored_config(Path(finished), "load", "")).as_dict()
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


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_out_peft_loads_in_peft_with_out_hfs_logits_and_init_resumes_its_adapters(arch, plays, tmp_path, caplog):
    """out/peft on the base checkpoint computes what out/hf does (GPT-2's Conv1D projections:
    fan_in_fan_out; the Llama layout's nn.Linear ones), and a run from init=out/peft starts with
    the finished run's adapters exactly."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from helpers import global_weights, train

    model_dir = tiny_hf_model(tmp_path / arch, arch)
    config = dict(
        dataset="shakespeare_lm", data_dir=plays, model="hf", model_dir=str(model_dir), seq_len=32, lora="4:8",
        algorithm="sfl_v2", clients=2, batch_size=4, local_steps=2, rounds=2, device="cpu", optimizer="sgd", lr=0.5,
        lora_dropout=0.1,
    )  # fmt: skip
    out = tmp_path / "run"
    summary = run(dict(config, out=str(out)), progress=False)
    assert summary["peft_export"] == str(out / "peft")
    adapter_config = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert [adapter_config[key] for key in ("r", "lora_alpha", "lora_dropout", "fan_in_fan_out")] == [
        4, 8, 0.1, arch == "gpt2"
    ]  # fmt: skip
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(out / "hf", local_files_only=True).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).eval()
    with torch.no_grad():
        before = base(tokens).logits
        adapted = PeftModel.from_pretrained(base, out / "peft").eval()
        logits, expected = adapted(tokens).logits, merged(tokens).logits
    assert float((logits - expected).abs().max()) <= 1e-5
    assert float((logits - before).abs().max()) > 1e-3  # the adapters trained

    final = load_file(out / "weights.safetensors")
    resumed = global_weights(train(0, **dict(config, init=str(out / "peft"))))
    assert resumed and all(torch.equal(t, final[name]) for name, t in resumed.items())
    with pytest.raises(UserError, match=r"holds LoRA adapters of r=4, lora_alpha=8: give lora=4:8"):
        train(0, **dict(config, init=str(out / "peft"), lora="2:8"))
    theirs, targets = ("c_attn", "c_proj") if arch == "gpt2" else ("q_proj, v_proj", "k_proj")
    mismatch = rf"its adapters do not fit this run's \(theirs on {theirs}, this run's on {targets};"
    with pytest.raises(UserError, match=mismatch):
        train(0, **dict(config, init=str(out / "peft"), lora_targets=targets))

    other = tiny_hf_model(tmp_path / "other", arch, seed=1)  # the same shapes, other weights
    refused = rf"holds LoRA adapters trained on other weights than model_dir={other}'s \(their base: {model_dir}\)"
    with pytest.raises(UserError, match=refused):  # by the digest splitlab recorded
        train(0, **dict(config, model_dir=str(other), init=str(out / "peft")))
    foreign = tmp_path / "foreign"  # written by peft itself: no digest, the base named in its config only
    foreign.mkdir()
    save_file(load_file(out / "peft" / "adapter_model.safetensors"), foreign / "adapter_model.safetensors")
    for base in (str(other), str(model_dir), "org/hub-id"):
        (foreign / "adapter_config.json").write_text(json.dumps({**adapter_config, "base_model_name_or_path": base}))
        if base == str(other):
            with pytest.raises(UserError, match=r"trained on other weights than model_dir="):
                train(0, **dict(config, init=str(foreign)))
        else:
            theirs, ours = (global_weights(train(0, **dict(config, init=str(i)))) for i in (foreign, out / "peft"))
            assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert "its adapters' base model 'org/hub-id' is not a local folder, so it cannot be compared" in caplog.text


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


def test_config_yaml_records_the_datasets_sequence_length_where_none_is_given(plays, tmp_path):
    """The stored config reruns the same thing: it says seq_len=64 (shakespeare_lm's), not null."""
    from helpers import TINY_GPT

    config = dict(dataset="shakespeare_lm", data_dir=plays, **{**TINY_GPT, "context": 64}, algorithm="sl")
    del config["seq_len"]
    run(dict(config, clients=2, rounds=1, local_steps=1, batch_size=4, device="cpu", out=str(tmp_path / "run")),
        progress=False)  # fmt: skip
    stored = stored_config(tmp_path / "run")
    assert stored["seq_len"] == 64 and resolve_config({"dataset": "e2e", "model": "gpt"}).run.seq_len == 128
    assert resolve_config({"dataset": "digits"}).run.seq_len is None
    assert run_model(tmp_path / "run")[3]["seq_len"] == 64
