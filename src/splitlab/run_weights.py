"""A run's weights in and out of files: `init=RUN_DIR` (a finished run's model, adapters merged) or
`init=PEFT_DIR` (LoRA adapters in peft's format) for every model of a run to start from, and the
finished model written as a Hugging Face folder (`out/hf`) with its adapters in peft's format
(`out/peft`). The settings read `init_state` as they build a run's roles and the loop writes the
exports, so this sits beside them, below the commands that use a finished run (splitlab.runmodel).

A run's `weights.safetensors` holds its whole model under the stage names, adapters (LoRA) beside
the frozen base; the model itself is rebuilt from the run's `config.yaml`.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitlab.assembly import load_data
from splitlab.codec import read_header, read_tensors
from splitlab.config import ResolvedConfig, parse_lora
from splitlab.data import Dataset
from splitlab.errors import UserError
from splitlab.models import StagedModel, build_model
from splitlab.models.lora import ADAPTERS, adapter_state, merge_lora
from splitlab.resolve import resolve_config
from splitlab.rundir import DECODING, stored_config


def decoding_record(data: Dataset) -> dict[str, Any]:
    """What decoding a finished language run needs beside its weights (the run directory's DECODING
    file, written as it starts): how its rows began (`Dataset.rows`), its sequence length and
    vocabulary, so that `splitlab generate` reads no data (its files may be gone, or named relative
    to another folder)."""
    return {
        "rows": data.rows,
        "seq_len": data.input_shape[0],
        "vocab_size": data.num_classes,
        "vocabulary": data.vocabulary,
    }


def run_model(run_dir: str | Path) -> tuple[ResolvedConfig, StagedModel, Any, dict[str, Any]]:
    """The run's resolved config, its trained model (adapters in place, eval mode, CPU), its tokenizer (a
    Hugging Face tokenizer, model=hf: the model folder's, or the run's export where that folder is
    gone; or a character vocabulary, a str) and its DECODING record (from the data where a run from
    before that file has none)."""
    path = Path(run_dir)
    resolved = resolve_config(stored_config(path, "load the model of", "give a finished run's directory"))
    config = resolved.run
    weights = _weights_file(path)
    if (path / DECODING).is_file():
        record = json.loads((path / DECODING).read_text())
    else:
        data = load_data(resolved)
        if data.task != "language":
            raise UserError(f"{str(path)!r} trained on {config.dataset}, not a language dataset")
        record = decoding_record(data)
    settings = resolved.model_settings()
    if config.model == "hf" and not Path(str(settings["model_dir"])).is_dir() and (path / "hf").is_dir():
        settings["model_dir"] = str(path / "hf")
    model = build_model(config.model, (record["seq_len"],), record["vocab_size"], config.seed, **settings)
    model.load_state_dict(read_tensors(weights))
    if config.model == "hf":
        from splitlab.models.hf import load_tokenizer

        return resolved, model.eval(), load_tokenizer(str(settings["model_dir"])), record
    return resolved, model.eval(), record["vocabulary"], record


def _weights_file(run_dir: Path) -> Path:
    weights = run_dir / "weights.safetensors"
    if not weights.is_file():
        raise UserError(f"{str(run_dir)!r} holds no weights.safetensors: the run is unfinished or has no global model")
    return weights


@functools.cache
def base_state(run_dir: str) -> dict[str, torch.Tensor]:
    """The plain weights of a finished run's model (adapters merged), for `init=RUN_DIR`."""
    return merge_lora(run_model(run_dir)[1])


def init_state(config: ResolvedConfig) -> dict[str, torch.Tensor] | None:
    """The weights every model of a run with `init=` starts from (None without `init`): a finished
    run's, adapters merged, or a peft folder's adapters (`peft_adapters`). Whoever builds the run's
    `Blueprint` hands them to it."""
    init = config.run.init
    if init is None:
        return None
    return peft_adapters(config) if is_peft_folder(init) else base_state(init)


def init_shapes(config: ResolvedConfig) -> dict[str, torch.Tensor] | None:
    """`init_state`'s names and shapes as meta tensors, read without any data (from the finished
    run's weights file's header; a peft folder's adapters), to check that they fit before the data
    is read and tokenised."""
    run = config.run
    if run.init is None:
        return None
    if is_peft_folder(run.init):
        return {name: t.to("meta") for name, t in peft_adapters(config).items()}
    path = Path(run.init)
    stored_config(path, "load the model of", "give a finished run's directory")
    shapes = read_header(_weights_file(path))[0]
    return {name: torch.empty(shape, device="meta") for name, shape in shapes.items() if not name.endswith(ADAPTERS)}


def is_peft_folder(path: str | Path) -> bool:
    from splitlab.models.hf import ADAPTER_CONFIG

    return (Path(path) / ADAPTER_CONFIG).is_file()


def peft_adapters(config: ResolvedConfig) -> dict[str, torch.Tensor]:
    """`init=PEFT_DIR`: its LoRA adapters under stage names, for a model=hf run with the same rank
    and alpha (`lora=`), on the checkpoint they adapt (`model_dir=`)."""
    from splitlab.models import hf

    run = config.run
    if run.model != "hf":
        raise UserError(f"init={run.init} holds peft adapters, which start a model=hf run (model_dir=their base)")
    theirs, adapters = hf.read_peft(str(run.init), str(config.model_dir))
    trained = f"{theirs.get('r')}:{theirs.get('lora_alpha')}"
    if run.lora is None or parse_lora(run.lora) != parse_lora(trained):
        raise UserError(
            f"init={run.init} holds LoRA adapters of r={theirs.get('r')}, lora_alpha="
            f"{theirs.get('lora_alpha')}: give lora={trained}, the rank and alpha they were trained with"
        )
    return adapters


def export_hf(
    resolved: ResolvedConfig, parts: list[nn.Module], vocabulary: str | None, out: Path, whole: bool = True
) -> dict[str, str]:
    """Write the model (client and server parts, adapters merged) to `out/hf`, a folder
    `transformers.AutoModelForCausalLM.from_pretrained` loads, with its tokenizer; with LoRA, its
    adapters to `out/peft`, a folder `peft.PeftModel.from_pretrained` loads on the model they adapt
    (`peft_base`). `whole=False` (a checkpoint of a LoRA run: save_every) leaves out the merged
    model. Returns the folders written, for summary.json (none for a model with no Hugging Face form)."""
    config = resolved.run
    if config.model not in ("gpt", "hf"):
        return {}
    from splitlab.models import hf

    state = {name: t for part in parts for name, t in merge_lora(part).items()}
    whole = whole or config.lora is None
    if config.model == "hf":
        model_dir = str(resolved.model_dir)
        if whole:
            hf.save_hf(state, model_dir, out / "hf")
        tokenizer = hf.export_tokenizer(model_dir)
        layout = hf.LAYOUTS[hf.read_config(model_dir)["model_type"]]
    else:
        sizes = resolved.model_params.model_dump()
        vocab = state["head.lm_head.weight"].shape[0]
        tokenizer = hf.char_tokenizer(vocabulary, sizes["context"]) if vocabulary is not None else None
        if whole:
            hf.save_gpt2(state, hf.gpt2_config(**sizes, vocab=vocab), out / "hf", tokenizer)
        layout = hf.GPT2
    written = {"hf_export": str(out / "hf")} if whole else {}
    if config.lora is not None:
        adapters = {name: t for part in parts for name, t in adapter_state(part).items()}
        lora = parse_lora(config.lora)
        hf.save_peft(adapters, layout, lora, config.lora_dropout, peft_base(resolved), tokenizer, out / "peft")
        written["peft_export"] = str(out / "peft")
    return written


def peft_base(config: ResolvedConfig) -> str:
    """The folder of the model a LoRA run's adapters apply to: the export of the finished run it
    started from (`init=RUN_DIR`: RUN_DIR/hf), else model=hf's `model_dir`."""
    init = config.run.init
    if init is not None and not is_peft_folder(init):
        return str((Path(init) / "hf").resolve())
    return str(Path(str(config.model_dir)).resolve())
