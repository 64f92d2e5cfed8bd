"""A finished run's model: starting another run from it (`init=RUN_DIR`), writing it as a Hugging
Face folder (`out/hf`), and generating text with it (`splitlab generate`).

A run's `weights.safetensors` holds its whole model under the stage names, adapters (LoRA) beside
the frozen base; the model itself is rebuilt from the run's `config.yaml`.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import nn

from splitlab.assembly import load_data
from splitlab.config import RunConfig
from splitlab.errors import UserError
from splitlab.generation import DecodingSettings, decode
from splitlab.models import MODELS, StagedModel, build_model, split
from splitlab.models.lora import merge_lora
from splitlab.resolve import resolve_config
from splitlab.rundir import stored_config


def run_model(run_dir: str | Path) -> tuple[RunConfig, StagedModel, Any, int]:
    """The run's config, its trained model (adapters in place, eval mode, CPU), its data's
    tokenizer (a Hugging Face tokenizer, model=hf, or a character vocabulary, a str) and its
    sequence length."""
    path = Path(run_dir)
    config = resolve_config(stored_config(path, "load the model of", "give a finished run's directory")).run
    weights = path / "weights.safetensors"
    if not weights.is_file():
        raise UserError(f"{str(path)!r} holds no weights.safetensors: the run is not finished or has no global model")
    data = load_data(config)
    if data.task != "language":
        raise UserError(f"{str(path)!r} trained on {config.dataset}, not a language dataset")
    model = build_model(config.model, data.input_shape, data.num_classes, config.seed, **config.model_settings())
    from safetensors.torch import load_file

    model.load_state_dict(load_file(weights))
    if config.model == "hf":
        from splitlab.models.hf import load_tokenizer

        return config, model.eval(), load_tokenizer(str(config.model_dir)), data.input_shape[0]
    return config, model.eval(), data.vocabulary, data.input_shape[0]


@functools.cache
def base_state(run_dir: str) -> dict[str, torch.Tensor]:
    """The plain weights of a finished run's model (adapters merged), for `init=RUN_DIR`."""
    return merge_lora(run_model(run_dir)[1])


def init_state(run: RunConfig) -> dict[str, torch.Tensor] | None:
    """The weights every model of a run with `init=RUN_DIR` starts from (None without `init`): the
    finished run's, adapters merged. Whoever builds the run's `Blueprint` hands them to it."""
    return None if run.init is None else base_state(run.init)


def export_hf(config: RunConfig, parts: list[nn.Module], vocabulary: str | None, out_dir: Path) -> bool:
    """Write the model (client and server parts, adapters merged) to `out_dir` as a folder
    `transformers.AutoModelForCausalLM.from_pretrained` loads, with its tokenizer; False (nothing
    written) for a model with no Hugging Face form."""
    if config.model not in ("gpt", "hf"):
        return False
    from splitlab.models import hf

    state = {name: t for part in parts for name, t in merge_lora(part).items()}
    if config.model == "hf":
        hf.save_hf(state, str(config.model_dir), out_dir)
        return True
    defaults = {k: p.default for k, p in inspect.signature(MODELS["gpt"]).parameters.items() if k != "input_shape"}
    sizes = {key: getattr(config, key) or defaults[key] for key in ("layers", "heads", "width", "context")}
    vocab = state["head.lm_head.weight"].shape[0]
    tokenizer = hf.char_tokenizer(vocabulary) if vocabulary is not None else None
    hf.save_gpt2(state, hf.gpt2_config(**sizes, vocab=vocab), out_dir, tokenizer)
    return True


def _encode(tokenizer: Any, text: str) -> list[int]:
    if isinstance(tokenizer, str):
        unknown = sorted({c for c in text if c not in tokenizer})
        if unknown:
            raise UserError(f"prompt has characters outside the model's vocabulary: {''.join(unknown)!r}")
        return [tokenizer.index(c) for c in text]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "".join(tokenizer[i] for i in ids) if isinstance(tokenizer, str) else tokenizer.decode(ids)


def generate(run_dir: str | Path, prompt: str, **decoding: Any) -> str:
    """`prompt` continued as `decoding` (splitlab.generation.DecodingSettings) says, each token
    through the client stages, then the server stages at the run's cut, on the last `seq_len`
    tokens; the text ends early at the tokenizer's end-of-sequence token, if it has one."""
    config, model, tokenizer, window = run_model(run_dir)
    client, server = split(model, config.cut)
    ids = _encode(tokenizer, prompt)
    if not ids:
        raise UserError('prompt is empty; give prompt="some text"')
    eos = None if isinstance(tokenizer, str) else tokenizer.eos_token_id
    produced = decode(lambda tokens: server(client(tokens)), ids, DecodingSettings(**decoding), window, eos)
    return prompt + _decode(tokenizer, produced)


class GenerateSettings(DecodingSettings):
    """`splitlab generate RUN KEY=VALUE ...`"""

    prompt: str = Field(description="the text to continue")
