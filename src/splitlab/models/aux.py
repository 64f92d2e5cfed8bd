"""Auxiliary models for CSE-FSL and FSL-SAGE: a small stand-in for the server part, run by a client.

An auxiliary model maps the cut-layer activations to logits, like the server part it imitates.
The four sizes of the FSL-SAGE paper's ablation (Appendix D.4), for any model and cut:

- `linear`: a head alone on the cut activations (global average pooling for feature maps, then
  one fully connected layer to the classes);
- `half`: the server part with half its depth, then a head. Stages of residual blocks keep the
  first ceil(d/2) of their d blocks (ResNet-18 cut 2: layer3 and layer4 with one block each);
  other models keep the first ceil(n/2) of their n hidden server stages;
- `stage`: the first server stage, then a head (the authors' default: ResNet-18 cut 2 gives
  layer3 + pooling + fc);
- `full`: the server part's whole architecture;
- `blocks:N`: the first N server stages, then the server part's own last stage (FSL-SAGE's GPT-2
  experiment: "the first 3 attention blocks cascaded with the language decoder", `blocks:3`).

Stages taken from the server part start from the server part's initial weights (so `full` starts
as an exact copy of the server part); heads are new layers initialised from the seed. On small
server parts several sizes coincide (a server part that is one classifier stage makes all four a
single linear layer).
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict

import torch
from torch import nn

from splitlab.errors import UserError
from splitlab.models.staged import StagedModel, output_shape, split
from splitlab.models.trainable import share_frozen_copy
from splitlab.models.zoo import Residual

AUX_KINDS: tuple[str, ...] = ("linear", "half", "stage", "full")  # and blocks:N


def parse_aux(kind: str) -> tuple[str, int]:
    """`stage` -> ("stage", 0); `blocks:3` -> ("blocks", 3)."""
    name, _, count = kind.partition(":")
    if name == "blocks" and count.isdecimal() and int(count) >= 1:
        return name, int(count)
    if kind in AUX_KINDS:
        return kind, 0
    raise UserError(f"unknown aux {kind!r}; available: {', '.join(AUX_KINDS)}, blocks:N (N >= 1)")


def build_aux(
    kind: str,
    model: StagedModel,
    cut: int,
    input_shape: tuple[int, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> nn.Sequential:
    """The `kind` auxiliary model for `model` (a freshly built StagedModel) split at `cut`."""
    kind, count = parse_aux(kind)
    server = split(model, cut)[1]
    if kind == "blocks":
        stages = list(server.named_children())
        if count >= len(stages):
            raise UserError(f"aux=blocks:{count}: the server part at cut {cut} has only {len(stages) - 1} blocks")
        return share_frozen_copy(nn.Sequential(OrderedDict(stages[:count] + stages[-1:])))
    try:
        smashed = smashed_shape(model, cut, input_shape, dtype)
        logits_shape = output_shape(server, smashed)
        hidden = list(server.named_children())[:-1]  # every server stage but the classifier
        if kind == "full":
            return copy.deepcopy(server)
        chosen = {"linear": [], "stage": list(server.named_children())[:1], "half": _halved(hidden)}[kind]
        body = nn.Sequential(OrderedDict((name, copy.deepcopy(stage)) for name, stage in chosen))
        if len(chosen) == len(server):  # the first stage is already the classifier
            return body
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            body.add_module("aux_head", _head(output_shape(body, smashed), logits_shape))
    except RuntimeError as err:
        raise UserError(f"aux={kind} is not available for this model at cut {cut}: {err}") from None
    return body


def smashed_shape(
    model: StagedModel, cut: int, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> tuple[int, ...]:
    """Shape of one sample's cut-layer activations (a dry run of the client part, on the CPU)."""
    return output_shape(split(model, cut)[0], input_shape, dtype)


def _halved(stages: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    residual = [
        (name, stage)
        for name, stage in stages
        if isinstance(stage, nn.Sequential) and all(isinstance(b, Residual) for b in stage)
    ]
    if residual and len(residual) == len(stages):  # every stage is a run of residual blocks
        return [(name, stage[: math.ceil(len(stage) / 2)]) for name, stage in residual]
    return stages[: math.ceil(len(stages) / 2)]


def _head(features: tuple[int, ...], logits: tuple[int, ...]) -> nn.Module:
    """Pooling (for feature maps) and one linear layer to the classes."""
    if len(logits) != 1:
        raise RuntimeError(f"a head gives one logit vector per sample, the server part gives shape {logits}")
    if len(features) == 3:  # (channels, height, width)
        return nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(features[0], logits[0]))
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(features), logits[0]))
