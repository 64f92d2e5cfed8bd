"""Model zoo and splitting. `build_model` is the one entry point; add a model with one MODELS entry,
or from outside the package with `splitlab.register_model`."""

from __future__ import annotations

import torch

from splitlab.errors import UserError
from splitlab.models.leaf import LEAF_MODELS
from splitlab.models.staged import StagedModel, largest_activation_bytes, output_shape, split
from splitlab.models.zoo import MODELS, ModelBuilder

MODELS.update(LEAF_MODELS)  # lstm, celeba_cnn, resnet9 (models/leaf.py builds on the zoo's blocks)


def register_model(name: str, builder: ModelBuilder) -> None:
    """Make `model=name` build `builder(input_shape, num_classes)`, a `StagedModel` (an ordered list
    of named stages; a cut is an index into it). A plugin's name may be registered again (the
    later builder counts), a built-in one may not."""
    if not name.isidentifier() or getattr(MODELS.get(name), "__module__", "").startswith("splitlab."):
        raise UserError(f"cannot register model {name!r}: expected a new name (letters, digits, _), not a built-in")
    MODELS[name] = builder


def model_names() -> list[str]:
    return sorted(MODELS)


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> StagedModel:
    """A freshly initialised model; the init depends only on `seed`, not on global RNG state."""
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; available: {', '.join(model_names())}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return MODELS[name](tuple(input_shape), num_classes)
        except RuntimeError as err:  # e.g. an image CNN asked to take sequences, or too small inputs
            raise UserError(f"model {name!r} does not fit inputs of shape {tuple(input_shape)}: {err}") from None


__all__ = [
    "MODELS",
    "ModelBuilder",
    "register_model",
    "StagedModel",
    "build_model",
    "largest_activation_bytes",
    "model_names",
    "output_shape",
    "split",
]
