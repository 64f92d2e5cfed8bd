"""What of a model moves: its state without the frozen parameters.

A model whose base is frozen (LoRA) trains, sends, averages and checkpoints only what changes:
its trainable parameters and its buffers. The frozen base is rebuilt from the configuration in
every process (same seed, same files) and held once per process, shared by every copy. For a
model without frozen parameters, `shared_state` is its whole `state_dict`.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn


def frozen_names(module: nn.Module) -> set[str]:
    """State-dict names of the parameters that do not train."""
    return {name for name, p in module.named_parameters() if not p.requires_grad}


def shared_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """`module`'s state without its frozen parameters: what is sent, averaged and checkpointed."""
    tensors = _tensors(module)
    if tensors is not None and tensors.whole:  # what state_dict gives, without walking the module tree
        return {name: t.detach() for name, t in tensors.shared.items()}
    frozen = frozen_names(module)
    state = module.state_dict()
    return state if not frozen else {name: t for name, t in state.items() if name not in frozen}


def load_shared(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load a `shared_state`: every non-frozen entry must be there, nothing else may be. A state
    that matches the module's own names, shapes and dtypes is copied straight into its tensors
    (what `load_state_dict` does, without its per-call walk of the module tree: the cost of giving
    a small client model its weights at every visit)."""
    tensors = _tensors(module)
    if tensors is not None and tensors.fits(state):
        with torch.no_grad():
            torch._foreach_copy_(list(tensors.shared.values()), [state[name] for name in tensors.shared])
        return
    frozen = frozen_names(module)
    if not frozen:
        module.load_state_dict(state)
        return
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [name for name in missing if name not in frozen]
    if missing or unexpected:
        raise RuntimeError(f"state does not fit the model's trainable part: missing {missing}, unexpected {unexpected}")


@dataclass(frozen=True)
class _Tensors:
    """A module's parameters and buffers as its shared state names them, found once per module."""

    shared: dict[str, torch.Tensor]
    #: no parameter was frozen when they were found (the state is the whole state_dict)
    whole: bool

    def fits(self, state: Mapping[str, torch.Tensor]) -> bool:
        return len(self.shared) == len(state) and all(
            name in state and state[name].shape == t.shape and state[name].dtype == t.dtype
            for name, t in self.shared.items()
        )


_FOUND: weakref.WeakKeyDictionary[nn.Module, _Tensors | None] = weakref.WeakKeyDictionary()


def _tensors(module: nn.Module) -> _Tensors | None:
    """`module`'s tensors by shared-state name; None where a submodule saves or loads in a way of
    its own (hooks, its own `_save_to_state_dict` or `_load_from_state_dict`), which only
    `state_dict` and `load_state_dict` honour. BatchNorm's own loading only fills in an old
    checkpoint's missing counter, which a full state never lacks."""
    if module not in _FOUND:
        plain = all(
            not (m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks)
            and not (m._state_dict_hooks or m._state_dict_pre_hooks)
            and type(m)._save_to_state_dict is nn.Module._save_to_state_dict
            and (
                type(m)._load_from_state_dict is nn.Module._load_from_state_dict
                or isinstance(m, nn.modules.batchnorm._NormBase)
            )
            for m in module.modules()
        )
        frozen = frozen_names(module)
        state = module.state_dict(keep_vars=True)
        found = _Tensors({k: v for k, v in state.items() if k not in frozen}, not frozen)
        _FOUND[module] = found if plain else None
    return _FOUND[module]


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
