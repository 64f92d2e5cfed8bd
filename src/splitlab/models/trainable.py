"""What of a model moves: its state without the frozen parameters.

A model whose base is frozen (LoRA) trains, sends, averages and checkpoints only what changes:
its trainable parameters and its buffers. The frozen base is rebuilt from the configuration in
every process (same seed, same files) and held once per process, shared by every copy. For a
model without frozen parameters, `shared_state` is its whole `state_dict`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TypeVar

import torch
from torch import nn


def frozen_names(module: nn.Module) -> set[str]:
    """State-dict names of the parameters that do not train."""
    return {name for name, p in module.named_parameters() if not p.requires_grad}


def shared_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state without its frozen parameters: what is sent, averaged and checkpointed."""
    frozen = frozen_names(module)
    state = module.state_dict()
    return state if not frozen else {name: t for name, t in state.items() if name not in frozen}


def load_shared(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a `shared_state`: every non-frozen entry must be there, nothing else may be."""
    frozen = frozen_names(module)
    if not frozen:
        module.load_state_dict(state)
        return
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in frozen]
    if missing or unexpected:
        raise RuntimeError(f"state does not fit the model's trainable part: missing {missing}, unexpected {unexpected}")


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def share_frozen_copy(module: ModuleT) -> ModuleT:
    """A deep copy that shares `module`'s frozen parameters instead of copying them, so that K
    copies (SFL-V1's server copies, clients' slots) hold the frozen base once."""
    memo = {id(p): p for p in module.parameters() if not p.requires_grad}
    return copy.deepcopy(module, memo)


def hold_frozen_in(module: nn.Module, dtype: torch.dtype) -> None:
    """Hold `module`'s frozen floating-point parameters in `dtype` (base_dtype=bfloat16: a LoRA
    model's base in half the memory); what trains keeps its own dtype, float32."""
    for parameter in module.parameters():
        if not parameter.requires_grad and parameter.is_floating_point():
            parameter.data = parameter.data.to(dtype)
