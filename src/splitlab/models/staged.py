"""Models as ordered lists of named stages, so that any cut is a valid split.

A cut is an index into the stage list: the client runs the stages before it, the server the rest.
Both parts share the unsplit model's module objects and therefore its state-dict names, which is
what lets an algorithm hand back one global model under the unsplit names. A U-shaped split has
two cuts A < B: the client holds the stages before A (its head) and from B on (its tail, with the
loss and the labels) in one part, `HeadAndTail`; the server holds the stages between.
"""

from __future__ import annotations

import contextlib
import math
import typing
from collections import OrderedDict
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from splitlab.errors import UserError
from splitlab.models import packed


def run_stages(stages: list[nn.Module], x: torch.Tensor, checkpointed: bool) -> torch.Tensor:
    """`stages` in order on `x`. `checkpointed` (gradient_checkpointing=): while gradients are
    recorded, each stage keeps only its input and is run again in the backward pass, with the
    random state its dropout drew from the first time and the packed rows it saw (models/packed.py),
    so the result is the same."""
    for stage in stages:
        if checkpointed and torch.is_grad_enabled():
            x = checkpoint(_in_rows, stage, packed.segments(), x, use_reentrant=False, preserve_rng_state=True)
        else:
            x = stage(x)
    return x


def _in_rows(stage: nn.Module, segments: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    with packed.rows(segments):
        return stage(x)


class Stages(nn.Sequential):
    """Named stages run in order, each checkpointed if `checkpointed` (`run_stages`)."""

    checkpointed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stages(list(self), x, self.checkpointed)


class StagedModel(Stages):
    """An `nn.Sequential` of named stages plus the paper's cut numbering.

    `cut_stages[c]` is how many stages the client holds at user-facing cut `c`. Most models use
    "cut c = after stage c"; ResNets use the papers' "cut i = after residual stage i", which puts
    the stem on the client as well.
    """

    def __init__(self, stages: OrderedDict[str, nn.Module], cut_stages: dict[int, int] | None = None):
        super().__init__(stages)
        self.cut_stages = cut_stages or {c: c for c in range(1, len(stages))}

    @property
    def valid_cuts(self) -> list[int]:
        return sorted(self.cut_stages)

    def client_stage_count(self, cut: int) -> int:
        if cut not in self.cut_stages:
            raise UserError(f"cut {cut} is out of range for this model; valid cuts: {self.valid_cuts}")
        return self.cut_stages[cut]


class HeadAndTail(Stages):
    """A U-shaped split's client part: its head's stages then its tail's, under the unsplit model's
    names (one slot, one optimizer, averaged as a whole). Calling it runs the head (its output
    is the smashed data at cut A); `tail` runs the rest on the server's output at cut B."""

    def __init__(self, stages: list[tuple[str, nn.Module]], head_stages: int) -> None:
        super().__init__(OrderedDict(stages))
        self.head_stages = head_stages

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stages(list(self)[: self.head_stages], x, self.checkpointed)

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        return run_stages(list(self)[self.head_stages :], x, self.checkpointed)

    def tail_part(self) -> nn.Sequential:
        """The tail's stages as a model of their own (the same modules)."""
        return nn.Sequential(OrderedDict(list(self.named_children())[self.head_stages :]))

    def tail_parameters(self) -> list[nn.Parameter]:
        """The tail's trainable parameters, each once."""
        return [p for p in self.tail_part().parameters() if p.requires_grad]


class UShaped(nn.Sequential):
    """A U-shaped split model, (client part, server part): head, then the server's stages, then tail."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        client, server = self
        return typing.cast(HeadAndTail, client).tail(server(client(x)))


def split(model: StagedModel, cut: int, tail_cut: int | None = None) -> tuple[Stages, Stages]:
    """Split at `cut` into (client part, server part) that share the model's modules and names
    (and whether its stages are checkpointed); with a `tail_cut` too, U-shaped: (`HeadAndTail`,
    the stages between the two cuts)."""
    k = model.client_stage_count(cut)
    stages = list(model.named_children())
    parts: tuple[Stages, Stages]
    if tail_cut is None:
        parts = Stages(OrderedDict(stages[:k])), Stages(OrderedDict(stages[k:]))
    elif tail_cut not in model.cut_stages or model.cut_stages[tail_cut] <= k:
        later = [c for c in model.valid_cuts if model.cut_stages[c] > k]
        raise UserError(
            f"cut={cut},{tail_cut}: the second cut must be a later cut of this model; valid: {later or 'none'}"
        )
    else:
        tail = model.cut_stages[tail_cut]
        parts = HeadAndTail(stages[:k] + stages[tail:], k), Stages(OrderedDict(stages[k:tail]))
    for part in parts:
        part.checkpointed = model.checkpointed
    return parts


def joined(parts: list[nn.Module]) -> nn.Sequential:
    """The model of its parts (the whole model, or client part then server part) that runs them in order."""
    return UShaped(*parts) if isinstance(parts[0], HeadAndTail) else nn.Sequential(*parts)


@contextlib.contextmanager
def inference(*modules: nn.Module) -> Iterator[None]:
    """No gradients, and `modules` in eval mode for the block. Each submodule gets its own mode
    back after (a recursive `train(mode)` would switch on whatever the model keeps in eval mode,
    e.g. a checkpoint's dropout)."""
    modes = [(sub, sub.training) for module in modules for sub in module.modules()]
    try:
        with torch.no_grad():
            for module in modules:
                module.eval()
            yield
    finally:
        for sub, mode in modes:
            sub.training = mode


def output_shape(module: nn.Module, input_shape: tuple[int, ...], dtype=torch.float32) -> tuple[int, ...]:
    """Shape of one sample's output, found by a dry run; used to size layers after a cut."""
    with inference(module):
        out = module(torch.zeros((2, *input_shape), dtype=dtype))
    return tuple(out.shape[1:])


def largest_activation_bytes(module: nn.Module, input_shape: tuple[int, ...], dtype=torch.float32) -> int:
    """Bytes per sample of the largest output of any layer (the input included), by a dry run:
    what sizes an inference batch, since a layer's output is the most a forward pass holds at once."""
    sizes = [math.prod(input_shape) * dtype.itemsize]

    def record(_module: nn.Module, _inputs: object, output: object) -> None:
        if isinstance(output, torch.Tensor):
            sizes.append(output[0].numel() * output.element_size())

    hooks = [m.register_forward_hook(record) for m in module.modules()]
    try:
        output_shape(module, input_shape, dtype)
    finally:
        for hook in hooks:
            hook.remove()
    return max(sizes)
