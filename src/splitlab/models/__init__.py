"""Model zoo and splitting. `build_model` is the one entry point; add a model with one MODELS entry,
or from outside the package with `splitlab.register_model`.

A model's own keys (a GPT's `layers`, model=hf's `model_dir`) are a params model registered beside
its builder, as an algorithm's are its `Params`: `model=NAME KEY=VALUE` validates KEY against the
named model's params, and the builder is called with their values. A model also says which kinds of
samples it takes (images, features, tokens), so that one that does not fit a dataset is refused
before anything is loaded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from splitlab.data.datasets import SAMPLE_KINDS
from splitlab.errors import UserError, one_line
from splitlab.models.gpt import GptParams, gpt
from splitlab.models.hf import HfParams, hf_model
from splitlab.models.leaf import LEAF_MODELS
from splitlab.models.lora import key_dropouts
from splitlab.models.staged import (
    HeadAndTail,
    StagedModel,
    inference,
    joined,
    largest_activation_bytes,
    output_shape,
    split,
)
from splitlab.models.trainable import load_shared, share_frozen_copy, shared_state
from splitlab.models.zoo import MODELS, ModelBuilder


class NoModelParams(BaseModel):
    """For models without keys of their own."""

    model_config = ConfigDict(extra="forbid", frozen=True)


MODELS.update(LEAF_MODELS)  # lstm, celeba_cnn, resnet9 (models/leaf.py builds on the zoo's blocks)
MODELS["gpt"] = gpt
MODELS["hf"] = hf_model  # transformers is imported only when one is built
#: model name -> its own keys (models not here have none)
MODEL_PARAMS: dict[str, type[BaseModel]] = {"gpt": GptParams, "hf": HfParams}
#: model name -> the kinds of samples it takes (models not here: any, checked when built)
MODEL_INPUTS: dict[str, frozenset[str]] = {
    "mlp": frozenset({"images", "features"}),
    **{name: frozenset({"images"}) for name in ("cnn", "splitgp_cnn", "vgg11", "resnet18", "resnet50")},
    **{name: frozenset({"images"}) for name in ("celeba_cnn", "resnet9")},
    **{name: frozenset({"tokens"}) for name in ("lstm", "gpt", "hf")},
}
#: splitlab's own model names: never replaced by a plugin, and the only ones in its catalog
BUILT_IN = frozenset(MODELS)


def register_model(
    name: str,
    builder: ModelBuilder,
    params: type[BaseModel] | None = None,
    inputs: Iterable[str] | None = None,
) -> None:
    """Make `model=name` build `builder(input_shape, num_classes, **params)`, a `StagedModel` (an
    ordered list of named stages; a cut is an index into it). `params`: a pydantic model of the
    model's own keys, each with a default (`model=name KEY=VALUE`); `inputs`: the kinds of samples
    it takes, from SAMPLE_KINDS (None: any). A plugin's name may be registered again (the later
    builder counts), a built-in one may not."""
    if not name.isidentifier() or name in BUILT_IN:
        raise UserError(f"cannot register model {name!r}: expected a new name (letters, digits, _), not a built-in")
    unknown = sorted(set(inputs or ()) - set(SAMPLE_KINDS))
    if unknown:
        raise UserError(
            f"cannot register model {name!r}: inputs {unknown[0]!r} is not one of {', '.join(SAMPLE_KINDS)}"
        )
    MODELS[name] = builder
    MODEL_PARAMS.pop(name, None)
    MODEL_INPUTS.pop(name, None)
    if params is not None:
        MODEL_PARAMS[name] = params
    if inputs is not None:
        MODEL_INPUTS[name] = frozenset(inputs)


def model_names() -> list[str]:
    return sorted(MODELS)


def model_params(name: str) -> type[BaseModel]:
    """Model `name`'s own keys (a model without any: none)."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; available: {', '.join(model_names())}")
    return MODEL_PARAMS.get(name, NoModelParams)


def model_settings(name: str, options: dict[str, Any]) -> BaseModel:
    """Model `name`'s own keys validated; a key it does not take is refused, naming those it takes."""
    params = model_params(name)
    for key in options:
        if key not in params.model_fields:
            raise UserError(
                f"{key}= does not apply to model={name}; its settings: {', '.join(params.model_fields) or 'none'}"
            )
    try:
        return params(**options)
    except ValidationError as err:
        raise UserError(one_line(err)) from None


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    seed: int = 0,
    lora: tuple[int, float] | None = None,
    lora_targets: tuple[str, ...] | None = None,
    lora_dropout: float = 0.0,
    **options: Any,
) -> StagedModel:
    """A freshly initialised model; the init depends only on `seed`, not on global RNG state.

    `options` are the model's own keys (`model_params`: a GPT's layers, heads, ...), refused for a
    model that does not take them. `lora=(rank, alpha)` then freezes the base and wraps the
    `lora_targets` projections (None: the architecture's default) in low-rank adapters, with
    `lora_dropout` on their input in training. Keyed dropout layers (a checkpoint's, hf_dropout=checkpoint) are
    keyed by `seed` and their names."""
    settings = model_settings(name, options).model_dump()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = MODELS[name](tuple(input_shape), num_classes, **settings)
        except RuntimeError as err:  # e.g. an image CNN asked to take sequences, or too small inputs
            raise UserError(f"model {name!r} does not fit inputs of shape {tuple(input_shape)}: {err}") from None
        key_dropouts(model, seed)
        if lora is not None:
            from splitlab.models.lora import apply_lora

            apply_lora(model, lora[0], lora[1], lora_targets, lora_dropout, seed)
    return model


__all__ = [
    "MODELS",
    "MODEL_INPUTS",
    "MODEL_PARAMS",
    "NoModelParams",
    "HeadAndTail",
    "ModelBuilder",
    "StagedModel",
    "build_model",
    "joined",
    "largest_activation_bytes",
    "load_shared",
    "model_names",
    "model_params",
    "model_settings",
    "output_shape",
    "inference",
    "register_model",
    "share_frozen_copy",
    "shared_state",
    "split",
]
