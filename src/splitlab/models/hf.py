"""Hugging Face causal language models from a local folder, as staged models, and back.

`load_staged(model_dir)` reads a folder that `save_pretrained(..., safe_serialization=True)` wrote
(`config.json`, `model.safetensors` or its shards with `model.safetensors.index.json`, the
tokenizer) with transformers, imported here only, and hands back a `StagedModel` whose stages are
transformers' own modules:

- `embed`: token ids (B, T) int64 -> hidden states (B, T, D): the token embedding, plus GPT-2's
  learned positions and embedding dropout;
- `block1` .. `blockN`: one decoder layer each, (B, T, D) -> (B, T, D), causal. A block builds
  its own causal mask and, in the Llama layout, its own rotary position embeddings (recent
  transformers computes both once per model and passes them to every layer; here a layer may sit
  on the other side of the cut from the embedding);
- `head`: the final norm and the LM head -> logits (B, T, V).

Cut c is after block c: the client holds `embed` and blocks 1..c. Supported: `LAYOUTS` (the GPT-2
family, and the Llama layout shared by Llama, Qwen2, Mistral and SmolLM).

Tied embeddings. GPT-2, SmolLM and small Qwen2 models tie the LM head to the token embedding: one
tensor in two places. With a cut between them, the two sides cannot share a tensor, so each holds
its own copy (`head.lm_head.weight` starts as a clone of the embedding). That is exact while the
embedding is frozen, as under LoRA; a run that trains both lets them drift apart, and the export
then writes both and unties them in its config.

Names. A stage's state-dict names are transformers' names under a stage prefix, so the export is
a prefix swap (`to_hf_names`):

    embed.<x>             <-> transformer.<x>            (GPT-2: wte, wpe)   model.<x> (Llama: embed_tokens)
    block<i>.layer.<x>    <-> transformer.h.<i-1>.<x>                        model.layers.<i-1>.<x>
    head.<norm>.<x>       <-> transformer.ln_f.<x>                           model.norm.<x>
    head.lm_head.<x>      <-> lm_head.<x>

`model=gpt` (splitlab's plain-torch GPT-2) exports as GPT-2 through `save_gpt2`. Its names follow
GPT-2's without the `.layer` level: `embed.wte`, `embed.wpe`, `block<i>.ln_1`, `block<i>.attn.c_attn`,
`block<i>.attn.c_proj`, `block<i>.ln_2`, `block<i>.mlp.c_fc`, `block<i>.mlp.c_proj`, `head.ln_f`,
`head.lm_head` (no bias: GPT-2's LM head has none); its projections are `nn.Linear`, whose weight
is the transpose of GPT-2's `Conv1D`, so those four weights are transposed on the way out.

Attention runs eagerly (written-out softmax) by default: PyTorch's fused CPU attention kernels have
no second derivative, which FSL-SAGE's alignment step takes through the auxiliary model.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import sys
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from splitlab.codec import read_header, read_tensors
from splitlab.errors import UserError, not_utf8
from splitlab.io import atomic_folder, cpu_copy, write_safetensors
from splitlab.json_text import user_json
from splitlab.logs import LOGGER
from splitlab.models import packed
from splitlab.models.lora import KeyedDropout
from splitlab.models.staged import StagedModel

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@dataclass(frozen=True)
class Layout:
    """Where a family keeps its parts, under its causal-LM class."""

    body: str  # the base model's attribute: transformer / model
    layers: str  # the decoder layers' list, under the body: h / layers
    norm: str  # the final norm, under the body: ln_f / norm
    rotary: bool  # positions by rotary embeddings computed at model level (Llama) or learned (GPT-2)
    #: the config's dropout probabilities: 0 at load, unless hf_dropout=checkpoint (see `load_staged`)
    dropouts: tuple[str, ...]


GPT2 = Layout(
    body="transformer", layers="h", norm="ln_f", rotary=False, dropouts=("embd_pdrop", "attn_pdrop", "resid_pdrop")
)
LLAMA = Layout(body="model", layers="layers", norm="norm", rotary=True, dropouts=("attention_dropout",))
#: config.json's `model_type` -> layout.
LAYOUTS = {"gpt2": GPT2, "llama": LLAMA, "qwen2": LLAMA, "mistral": LLAMA}


#: What a Hugging Face Hub id looks like (`gpt2`, `openai-community/gpt2`), as opposed to a path.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _read_json(path: Path) -> Any:
    try:
        return user_json(path.read_text(encoding="utf-8"), str(path))
    except UnicodeDecodeError:
        raise UserError(f"{path}, {not_utf8(path)}") from None


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """`config.json` of a model folder that splitlab can load, checked in one line each: the folder,
    the config, safetensors weights (never a pickle), a supported `model_type`."""
    folder = Path(model_dir)
    if not folder.is_dir():
        hint = (
            f"; if {model_dir} is a Hugging Face Hub id: splitlab reads local folders only and downloads nothing, "
            f"so on a connected machine run `huggingface-cli download {model_dir} --local-dir DIR` (or save_pretrained"
            f"(DIR) the model and its tokenizer) and give model_dir=DIR"
            if HUB_ID.fullmatch(str(model_dir))
            else f" (a Hugging Face model folder: config.json, {WEIGHTS}, the tokenizer)"
        )
        raise UserError(f"model_dir={model_dir}: the folder does not exist{hint}")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UserError(f"model_dir={folder}: no config.json (not a Hugging Face model folder)")
    config = _read_json(config_file)
    if not (folder / WEIGHTS).is_file() and not (folder / WEIGHTS_INDEX).is_file():
        pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickled:
            raise UserError(
                f"model_dir={folder} holds only pickled weights ({', '.join(pickled)}), which splitlab never loads "
                f"(unpickling runs code); convert them to {WEIGHTS} with save_pretrained(..., safe_serialization=True)"
            )
        raise UserError(f"model_dir={folder}: no {WEIGHTS} or {WEIGHTS_INDEX}")
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in LAYOUTS:
        raise UserError(
            f"model_dir={folder}: architecture {model_type!r} is not supported; supported: {', '.join(LAYOUTS)}"
        )
    return config


def context_length(config: Mapping[str, Any]) -> int:
    """The most tokens a sequence may have: GPT-2's `n_positions`, the Llama layout's `max_position_embeddings`."""
    return int(config["n_positions"] if config["model_type"] == "gpt2" else config["max_position_embeddings"])


class GPT2Embedding(nn.Module):
    """GPT-2's token plus learned position embeddings, then dropout."""

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.wte(tokens) + self.wpe(packed.positions(tokens.shape[1], tokens.device)))


class TokenEmbedding(nn.Module):
    """The Llama layout's token embedding (positions enter each attention layer as rotations)."""

    def __init__(self, embed_tokens: nn.Embedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)


class DecoderBlock(nn.Module):
    """One transformers decoder layer that builds its own causal mask and rotary embeddings. In a
    packed batch (models/packed.py) the positions restart at each row, and transformers' mask,
    seeing them restart with no padding mask given, keeps attention within each row."""

    def __init__(self, layer: nn.Module, config: Any, index: int, rotary: nn.Module | None) -> None:
        super().__init__()
        from transformers import masking_utils

        self.layer = layer
        self.config = config
        self.rotary = rotary  # its buffers are not persistent: no state-dict entries
        layer_types = getattr(config, "layer_types", None)
        sliding = (
            layer_types[index] == "sliding_attention"
            if layer_types
            else getattr(config, "sliding_window", None) is not None
        )
        self.make_mask = (
            masking_utils.create_sliding_window_causal_mask if sliding else masking_utils.create_causal_mask
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = packed.positions(hidden.shape[1], hidden.device)
        mask = self.make_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
        )
        if self.rotary is None:
            return self.layer(hidden, attention_mask=mask)
        rotations = self.rotary(hidden, position_ids=positions)
        return self.layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotations)


def staged_from_hf(model: Any) -> StagedModel:
    """Stages made of a transformers causal LM's own modules (shared, not copied), except the LM
    head's weight where it is tied to the embedding, which is cloned (see the module docstring)."""
    layout = LAYOUTS[model.config.model_type]
    body = getattr(model, layout.body)
    embed: nn.Module = (
        GPT2Embedding(body.wte, body.wpe, body.drop) if layout is GPT2 else TokenEmbedding(body.embed_tokens)
    )
    token_embedding = body.wte if layout is GPT2 else body.embed_tokens
    if model.lm_head.weight is token_embedding.weight:
        model.lm_head.weight = nn.Parameter(token_embedding.weight.detach().clone())
    stages: OrderedDict[str, nn.Module] = OrderedDict(embed=embed)
    layers = getattr(body, layout.layers)
    for i, layer in enumerate(layers):
        rotary = copy.deepcopy(body.rotary_emb) if layout.rotary else None
        stages[f"block{i + 1}"] = DecoderBlock(layer, model.config, i, rotary)
    stages["head"] = nn.Sequential(OrderedDict([(layout.norm, getattr(body, layout.norm)), ("lm_head", model.lm_head)]))
    return StagedModel(stages, cut_stages={c: c + 1 for c in range(1, len(layers) + 1)})


def load_staged(model_dir: str | Path, checkpoint_dropout: bool = False) -> StagedModel:
    """The model in `model_dir` (float32) as stages `embed`, `block1`..`blockN`, `head`, in train
    mode like every model splitlab builds. transformers' dropout draws from torch's global random
    state, which no model may (a client computes the same in any process, and every copy of a part,
    FSL-SAGE's auxiliary model included, computes alike): so the checkpoint's dropout is off, or with
    `checkpoint_dropout` each dropout keeps its probability as a `KeyedDropout` (masks keyed by the
    run's seed, the layer and the input): its dropout layers are replaced, and each attention
    module's dropout of attention probabilities is made by its `attn_dropout` (`keyed_attention`)."""
    layout = LAYOUTS[read_config(model_dir)["model_type"]]
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # splitlab draws its own; a bar per load would cut through it

    from safetensors import SafetensorError

    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            dtype=torch.float32,
            use_safetensors=True,
            local_files_only=True,
            attn_implementation=_keyed_attention() if checkpoint_dropout else "eager",
            output_loading_info=True,
            **({} if checkpoint_dropout else dict.fromkeys(layout.dropouts, 0.0)),
        )
    except (OSError, SafetensorError) as err:  # a truncated or damaged weights file
        raise UserError(
            f"model_dir={model_dir}: cannot read its weights ({str(err).strip().splitlines()[0]})"
        ) from None
    model, info = loaded
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise UserError(f"model_dir={model_dir}: the weights lack {len(missing)} tensors of the model: {missing[:5]}")
    bad = next((name for name, t in model.state_dict().items() if not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise UserError(f"model_dir={model_dir}: its weights hold non-finite values ({bad!r} has NaN or inf)")
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Dropout) and module.p > 0:  # GPT-2's attention's attn_dropout among them
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, KeyedDropout(module.p))
        elif isinstance(getattr(module, "attention_dropout", None), float):  # the Llama layout's attention
            module.attn_dropout = KeyedDropout(module.attention_dropout)
    return staged_from_hf(model).train()


#: transformers' eager attention with its dropout of attention probabilities made by the attention
#: module's `attn_dropout` (hf_dropout=checkpoint), registered with transformers under this name
KEYED_ATTENTION = "splitlab_keyed_eager"


def _keyed_attention() -> str:
    """Register `keyed_attention` (and eager attention's masks) with transformers under KEYED_ATTENTION."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(KEYED_ATTENTION, keyed_attention)
    AttentionMaskInterface.register(KEYED_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    return KEYED_ATTENTION


def keyed_attention(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The model family's own eager attention (operation for operation), whose one dropout call, on
    the attention probabilities, is made by `module.attn_dropout`, a KeyedDropout, instead of
    torch's global random state."""
    eager = sys.modules[type(module).__module__].eager_attention_forward
    with _DropoutBy(module.get_submodule("attn_dropout")):
        return eager(module, *args, **kwargs)


class _DropoutBy(torch.overrides.TorchFunctionMode):
    """While active, `torch.nn.functional.dropout(x, ...)` is `dropout(x)`; every other call as it is."""

    def __init__(self, dropout: nn.Module) -> None:
        super().__init__()
        self.dropout = dropout

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.nn.functional.dropout:
            return self.dropout(args[0])
        return func(*args, **(kwargs or {}))


def skeleton(model_dir: str | Path) -> StagedModel:
    """`load_staged`'s stages without the weights (on the meta device: no memory, no time), for
    checks made before any data is read."""
    read_config(model_dir)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return staged_from_hf(model)


class HfParams(BaseModel):
    """`model=hf`'s own keys: the folder it is read from, and whether its dropout applies."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model_dir: str | None = Field(
        None, description="model=hf: a local Hugging Face causal-LM folder (config.json, *.safetensors, tokenizer)"
    )
    hf_dropout: Literal["off", "checkpoint"] = Field(
        "off",
        description="model=hf: off (no dropout in any copy) | checkpoint (its dropout probabilities in training, "
        "masks keyed by seed, layer and input, alike in every copy; docs/language-hf.md)",
    )


def hf_model(
    input_shape: tuple[int, ...], num_classes: int, model_dir: str | None, hf_dropout: str = "off"
) -> StagedModel:
    """`model=hf`: the checkpoint in `model_dir` for sequences of `input_shape[0]` tokens whose ids
    are below `num_classes` (a model-zoo builder: `splitlab.models.MODELS`). Its logits cover the
    model's whole vocabulary, which may be larger than `num_classes`."""
    if model_dir is None:
        raise UserError("model=hf needs model_dir=DIR, a Hugging Face model folder (docs/language-hf.md)")
    config = read_config(model_dir)
    if len(input_shape) != 1:
        raise UserError(f"model=hf takes token sequences; the dataset's samples have shape {input_shape}")
    if input_shape[0] > context_length(config):
        raise UserError(f"seq_len={input_shape[0]} is beyond the model's context of {context_length(config)} tokens")
    if num_classes > config["vocab_size"]:
        raise UserError(
            f"the dataset's tokens go up to {num_classes - 1}, beyond the model's vocabulary of {config['vocab_size']}"
        )
    return load_staged(model_dir, checkpoint_dropout=hf_dropout == "checkpoint")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The folder's tokenizer (`tokenizer.json`, or GPT-2's `vocab.json` + `merges.txt`), read locally."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as err:
        raise UserError(f"model_dir={model_dir}: no usable tokenizer (tokenizer.json expected): {err}") from None


def to_hf_names(state: Mapping[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Stage names -> transformers' names (the table in the module docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        stage, _, rest = name.partition(".")
        if stage == "embed":
            out[f"{layout.body}.{rest}"] = tensor
        elif stage.startswith("block"):
            inner = rest.removeprefix("layer.")
            out[f"{layout.body}.{layout.layers}.{int(stage[5:]) - 1}.{inner}"] = tensor
        elif rest.startswith("lm_head."):
            out[rest] = tensor
        else:
            out[f"{layout.body}.{rest}"] = tensor
    return out


def save_hf(state: Mapping[str, torch.Tensor], model_dir: str | Path, out_dir: str | Path) -> None:
    """Write `state` (a staged model's state dict under stage names, adapters merged: `merge_lora`)
    as a folder `AutoModelForCausalLM.from_pretrained` loads, with `model_dir`'s config and tokenizer."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    generation = Path(model_dir) / "generation_config.json"  # the model's decoding defaults, if it has them
    hf_state = to_hf_names(state, LAYOUTS[config.model_type])
    _write(hf_state, config, export_tokenizer(model_dir), Path(out_dir), generation if generation.is_file() else None)


def export_tokenizer(model_dir: str | Path) -> Any:
    """The folder's tokenizer as an export writes it: at most the model's context long (not
    transformers' 1e30 when the folder says nothing), its end-of-sequence token padding where it
    has no pad token (what batched generation needs)."""
    tokenizer = load_tokenizer(model_dir)
    tokenizer.model_max_length = min(tokenizer.model_max_length, context_length(read_config(model_dir)))
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


#: `model=gpt`'s `nn.Linear` weights that GPT-2 stores as `Conv1D` (in x out).
GPT2_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def gpt2_config(layers: int, heads: int, width: int, context: int, vocab: int) -> Any:
    """The `GPT2Config` of `model=gpt` with these sizes: exact GELU (torch's `nn.GELU`, not GPT-2's
    tanh approximation), layer-norm epsilon 1e-5, no dropout, LM head not tied, token 0 ending and
    padding a sequence (as in `char_tokenizer`)."""
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=layers,
        n_head=heads,
        n_embd=width,
        n_positions=context,
        vocab_size=vocab,
        activation_function="gelu",
        layer_norm_epsilon=1e-5,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=0,
        pad_token_id=0,
    )


def save_gpt2(state: Mapping[str, torch.Tensor], config: Any, out_dir: str | Path, tokenizer: Any = None) -> None:
    """Write `model=gpt`'s state (stage names, adapters merged) as a GPT-2 folder for `config`
    (`gpt2_config`), with `tokenizer` (e.g. `char_tokenizer`) if given."""
    if "head.lm_head.bias" in state:
        raise ValueError("GPT-2's LM head has no bias: model=gpt must build its lm_head with bias=False to export")
    staged = {name: tensor.T if name.partition(".")[2] in GPT2_CONV1D else tensor for name, tensor in state.items()}
    _write(to_hf_names(staged, GPT2), config, tokenizer, Path(out_dir))


def char_tokenizer(characters: str, context: int) -> Any:
    """A tokenizer whose tokens are the single `characters`, in order (token i is `characters[i]`):
    `model=gpt`'s character vocabulary, so its export decodes text in transformers. A character
    vocabulary has no special tokens, so its first character (a newline, in the plays') ends and
    pads a sequence; sequences are at most `context` tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({c: i for i, c in enumerate(characters)}, unk_token=characters[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    first = characters[0]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=first, pad_token=first, model_max_length=context
    )


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: the metadata key of adapter_model.safetensors holding `weights_digest` of the model the adapters adapt
BASE_DIGEST = "splitlab.base_weights"
#: where peft's `PeftModel` keeps the model it adapts: adapter names are `<PEFT_PREFIX><module>.lora_A.weight`
PEFT_PREFIX = "base_model.model."


def save_peft(
    adapters: Mapping[str, torch.Tensor],
    layout: Layout,
    lora: tuple[int, float],
    dropout: float,
    base: str,
    tokenizer: Any,
    out_dir: str | Path,
) -> None:
    """Write LoRA `adapters` (`...lora_A`, `...lora_B` under stage names) as a folder that peft's
    `PeftModel.from_pretrained(base_model, out_dir)` loads on the model in `base`. The maths is
    peft's: `lora_A` (r x in) and `lora_B` (out x r) are its `lora_A.weight` and `lora_B.weight`,
    scaled `lora_alpha / r`; GPT-2's projections are `Conv1D`s (`fan_in_fan_out`)."""
    tensors = {}
    for name, tensor in to_hf_names(adapters, layout).items():
        module, _, kind = name.rpartition(".")
        tensors[f"{PEFT_PREFIX}{module}.{kind}.weight"] = cpu_copy(tensor)
    rank, alpha = lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else alpha,
        "lora_dropout": dropout,
        "target_modules": sorted({name.rpartition(".")[0] for name in to_hf_names(adapters, layout)}),
        "fan_in_fan_out": layout is GPT2,
        "bias": "none",
        "inference_mode": True,
    }
    digest = weights_digest(Path(base))
    with atomic_folder(Path(out_dir)) as tmp:
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        metadata = {"format": "pt", **({BASE_DIGEST: digest} if digest else {})}
        write_safetensors(tmp / ADAPTER_WEIGHTS, tensors, metadata=metadata)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)


def from_hf_name(name: str, layout: Layout) -> str:
    """transformers' name -> `load_staged`'s stage name (`to_hf_names` backwards)."""
    rest = name.removeprefix(f"{layout.body}.")
    if rest == name:  # lm_head.<x>
        return f"head.{name}"
    if rest.startswith(f"{layout.layers}."):
        index, _, inner = rest.removeprefix(f"{layout.layers}.").partition(".")
        return f"block{int(index) + 1}.layer.{inner}"
    return f"head.{rest}" if rest.startswith(f"{layout.norm}.") else f"embed.{rest}"


def read_peft(folder: str | Path, model_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A peft LoRA folder's `adapter_config.json` and its adapters under `load_staged`'s names, for a
    model of `model_dir`'s layout; one line for what splitlab cannot take (another method, pickled
    adapters, names of another model)."""
    path = Path(folder)
    config = _read_json(path / ADAPTER_CONFIG)
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind != "LORA":
        raise UserError(f"init={path}: peft adapters of type {kind!r}; splitlab takes LORA")
    if not (path / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"init={path}: no {ADAPTER_WEIGHTS} (splitlab never unpickles adapter_model.bin)")
    tensors = read_tensors(path / ADAPTER_WEIGHTS)
    layout = LAYOUTS[read_config(model_dir)["model_type"]]
    _check_base(path, config.get("base_model_name_or_path"), read_header(path / ADAPTER_WEIGHTS)[1], Path(model_dir))
    adapters = {}
    for name, tensor in tensors.items():
        inner = name.removeprefix(PEFT_PREFIX).removesuffix(".weight")
        if not name.startswith(PEFT_PREFIX) or not inner.endswith((".lora_A", ".lora_B")):
            raise UserError(f"init={path}: {name!r} is not a LoRA adapter of peft's ({PEFT_PREFIX}...lora_A.weight)")
        adapters[from_hf_name(inner, layout)] = tensor
    return config, adapters


def weights_digest(folder: Path) -> str | None:
    """sha256 over a model folder's safetensors files (names and bytes, in name order), None where it
    holds none: what tells the model adapters were trained on from another of the same shapes."""
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        digest.update(f"{file.name}\0".encode())
        with file.open("rb") as stream:
            while chunk := stream.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def _check_base(folder: Path, base: Any, metadata: dict[str, str], model_dir: Path) -> None:
    """Adapters apply to the weights they were trained on: `model_dir`'s must be those splitlab
    recorded when it wrote them (BASE_DIGEST), else those of the base folder their config names; a
    base that is not a local folder cannot be compared, which a warning says."""
    recorded = metadata.get(BASE_DIGEST) or (weights_digest(Path(base)) if isinstance(base, str) and base else None)
    if recorded is None:
        LOGGER.warning(
            f"init={folder}: its adapters' base model {base!r} is not a local folder, so it cannot be compared with "
            f"model_dir={model_dir}: make sure it is the model they were trained on"
        )
    elif recorded != weights_digest(model_dir):
        raise UserError(
            f"init={folder} holds LoRA adapters trained on other weights than model_dir={model_dir}'s (their base: "
            f"{base}); give model_dir= the model they adapt"
        )


def _untie_if_trained(hf_state: dict[str, torch.Tensor], config: Any) -> None:
    """Keep the tie where the two copies are still equal (frozen embedding); otherwise untie."""
    layout = LAYOUTS[config.model_type]
    embedding = hf_state[f"{layout.body}.{'wte' if layout is GPT2 else 'embed_tokens'}.weight"]
    if config.tie_word_embeddings and torch.equal(hf_state["lm_head.weight"], embedding):
        del hf_state["lm_head.weight"]
    else:
        config.tie_word_embeddings = False


def _write(
    hf_state: dict[str, torch.Tensor], config: Any, tokenizer: Any, out_dir: Path, generation: Path | None = None
) -> None:
    """The folder written whole into a temporary sibling, then moved into place: never half a model."""
    hf_state = dict(hf_state)
    _untie_if_trained(hf_state, config)
    config.dtype = next(iter(hf_state.values())).dtype
    with atomic_folder(out_dir) as tmp:
        config.save_pretrained(tmp)
        write_safetensors(tmp / WEIGHTS, {n: cpu_copy(t) for n, t in hf_state.items()}, metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if generation is not None:
            shutil.copyfile(generation, tmp / generation.name)
