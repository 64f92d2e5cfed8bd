"""Mistakes in a model=hf run's model keys: one line, exit 2, no run directory, and found before
any data is read or tokenised (the data loader here fails if it is reached)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hf_helpers import tiny_hf_model
from splitlab.cli import main
from splitlab.settings import horizontal


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return tiny_hf_model(tmp_path_factory.mktemp("hf") / "gpt2", "gpt2")  # 3 blocks, context 64


@pytest.fixture
def refused(plays, tmp_path, monkeypatch, capsys):
    """The CLI's one-line error for a run with `args` (model=hf unless they give a model), checked to
    come before the data."""

    def never(*_args, **_kwargs):
        raise AssertionError("the data was read before the model's keys were checked")

    monkeypatch.setattr(horizontal, "load_data", never)
    monkeypatch.chdir(tmp_path)

    def error(*args: str) -> str:
        model = [] if any(arg.startswith("model=") for arg in args) else ["model=hf"]
        common = ["dataset=shakespeare_lm", f"data_dir={plays}", "device=cpu", *model]
        assert main(["run", *common, *args, f"out={tmp_path}/run", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and not (tmp_path / "run").exists(), err
        return err

    return error


def test_a_hub_id_is_told_that_splitlab_reads_local_folders_only(refused):
    err = refused("model_dir=openai-community/gpt2")
    assert (
        "model_dir=openai-community/gpt2: the folder does not exist; if openai-community/gpt2 is a Hugging Face" in err
    )
    assert "splitlab reads local folders only and downloads nothing" in err
    assert "huggingface-cli download openai-community/gpt2 --local-dir DIR" in err


def test_a_missing_folder_is_said_not_to_exist(refused, tmp_path):
    err = refused(f"model_dir={tmp_path}/nowhere")
    assert f"model_dir={tmp_path}/nowhere: the folder does not exist (a Hugging Face model folder" in err


def test_an_unsupported_architecture_is_refused_before_tokenising(refused, gpt2, tmp_path):
    bert = tmp_path / "bert"
    bert.mkdir()
    for file in gpt2.iterdir():
        (bert / file.name).write_bytes(file.read_bytes())
    (bert / "config.json").write_text(
        json.dumps({**json.loads((gpt2 / "config.json").read_text()), "model_type": "bert"})
    )
    assert "architecture 'bert' is not supported; supported: gpt2, llama, qwen2, mistral" in refused(
        f"model_dir={bert}"
    )


def test_a_cut_out_of_range(refused, gpt2):
    assert "cut 9 is out of range for this model; valid cuts: [1, 2, 3]" in refused(f"model_dir={gpt2}", "cut=9")


def test_a_sequence_beyond_the_context(refused, gpt2):
    assert "seq_len=100 is beyond the model's context of 64 tokens" in refused(f"model_dir={gpt2}", "seq_len=100")


def test_lora_targets_of_another_layout(refused, gpt2):
    err = refused(f"model_dir={gpt2}", "lora=4:8", "lora_targets=q_proj")
    assert "lora_targets: 'q_proj' names no linear layer of this model; available: c_attn, c_proj, c_fc, lm_head" in err


def test_lora_that_leaves_a_part_nothing_to_train_names_what_would(refused, gpt2):
    err = refused(f"model_dir={gpt2}", "lora=4:8", "cut=3")  # c_attn only: the server part holds the head alone
    assert (
        "cut=3 leaves the server part nothing to train (lora trains only its adapters, none in that part); "
        "cuts that train both parts: 1, 2; or add to lora_targets one of the server part's layers: lm_head"
    ) in err
    err = refused(f"model_dir={gpt2}", "lora=4:8", "lora_targets=lm_head")
    assert "cut=1 leaves the client part nothing to train" in err
    assert "add to lora_targets one of the client part's layers: c_attn, c_proj, c_fc" in err


def test_init_of_another_models_run(refused, gpt2, tmp_path):
    other = tmp_path / "other_run"  # a finished model=gpt run: its config and weights
    other.mkdir()
    (other / "config.yaml").write_text("dataset: shakespeare_lm\nmodel: gpt\nlayers: 1\nwidth: 16\nheads: 2\n")
    save_file(
        {"embed.wte.weight": torch.zeros(80, 16), "block1.attn.c_attn.weight": torch.zeros(48, 16)},
        other / "weights.safetensors",
    )
    assert f"init={other}: its model does not fit this run's (" in refused(f"model_dir={gpt2}", f"init={other}")


def test_lora_on_a_model_that_is_not_pretrained(refused):
    for model in ("model=cnn", "model=gpt"):
        err = refused(model, "lora=4:8")
        assert "lora=4:8 does not apply here: LoRA fine-tunes a pretrained model's weights" in err
        assert "give init=RUN_DIR (a finished run of this model) or model=hf model_dir=DIR" in err


def test_init_of_a_model_gpt_run_of_other_sizes_is_caught_on_the_skeleton(refused, tmp_path):
    other = tmp_path / "other_run"  # a finished model=gpt run of width 16, where this run's GPT is 32 wide
    other.mkdir()
    (other / "config.yaml").write_text("dataset: shakespeare_lm\nmodel: gpt\nlayers: 1\nwidth: 16\nheads: 2\n")
    save_file({"embed.wte.weight": torch.zeros(80, 16)}, other / "weights.safetensors")
    err = refused("model=gpt", "layers=1", "heads=2", "width=32", f"init={other}", "lora=4:8")
    assert f"init={other}: its model does not fit this run's (" in err


def test_a_model_gpt_sequence_beyond_its_context_is_caught_on_the_skeleton(refused):
    assert "seq_len=64 is beyond the model's context of 32 tokens" in refused("model=gpt", "context=32")
