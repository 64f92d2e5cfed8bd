"""Model zoo and splitting. `build_model` is the one entry point; add a model with one MODELS entry,
or from outside the package with `splitlab.register_model`."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from splitlab.errors import UserError
from splitlab.models.gpt import gpt
from splitlab.models.hf import hf_model
from splitlab.models.leaf import LEAF_MODELS
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

MODELS.update(LEAF_MODELS)  # lstm, celeba_cnn, resnet9 (models/leaf.py builds on the zoo's blocks)
MODELS["gpt"] = gpt
MODELS["hf"] = hf_model  # transformers is imported only when one is built
#: splitlab's own model names: never replaced by a plugin, and the only ones in its catalog
BUILT_IN = frozenset(MODELS)


def register_model(name: str, builder: ModelBuilder) -> None:
    """Make `model=name` build `builder(input_shape, num_classes)`, a `StagedModel` (an ordered list
    of named stages; a cut is an index into it). A plugin's name may be registered again (the
    later builder counts), a built-in one may not."""
    if not name.isidentifier() or name in BUILT_IN:
        raise UserError(f"cannot register model {name!r}: expected a new name (letters, digits, _), not a built-in")
    MODELS[name] = builder


def model_names() -> list[str]:
    return sorted(MODELS)


def model_option_names(name: str) -> list[str]:
    """The settings (config keys) model `name`'s builder takes beyond the data's shape and classes."""
    return list(inspect.signature(MODELS[name]).parameters)[2:]


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

    `options` are the model's own settings (`model_option_names`: a GPT's layers, heads, ...), refused
    for a model that does not take them. `lora=(rank, alpha)` then freezes the base and wraps the
    `lora_targets` projections (None: the architecture's default) in low-rank adapters, with
    `lora_dropout` on their input in training."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; available: {', '.join(model_names())}")
    allowed = model_option_names(name)
    for key in options:
        if key not in allowed:
            raise UserError(f"{key}= does not apply to model={name}; its settings: {', '.join(allowed) or 'none'}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = MODELS[name](tuple(input_shape), num_classes, **options)
        except RuntimeError as err:  # e.g. an image CNN asked to take sequences, or too small inputs
            raise UserError(f"model {name!r} does not fit inputs of shape {tuple(input_shape)}: {err}") from None
        if lora is not None:
            from splitlab.models.lora import apply_lora

            apply_lora(model, lora[0], lora[1], lora_targets, lora_dropout, seed)
    return model


__all__ = [
    "MODELS",
    "HeadAndTail",
    "ModelBuilder",
    "StagedModel",
    "build_model",
    "joined",
    "largest_activation_bytes",
    "load_shared",
    "model_names",
    "model_option_names",
    "output_shape",
    "inference",
    "register_model",
    "share_frozen_copy",
    "shared_state",
    "split",
]
