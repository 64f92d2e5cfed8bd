"""Plain SGD without torch.optim's per-step bookkeeping.

`torch.optim.SGD.step` spends some 40 microseconds of Python a step (its profiler record, the
step hooks' lookup, grouping the tensors by device and dtype; `zero_grad` its own record) around
the one multi-tensor kernel that does the update. With many small clients, each taking a couple
of steps of a small model, that is a few percent of the run. Without momentum the update is that
one kernel (after weight decay's), called here directly: the same kernels in the same order as
torch's foreach path (`_multi_tensor_sgd` in torch/optim/sgd.py), so the same bits. With
momentum, a closure or a step hook registered, torch's own step runs, hooks and all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch.optim import optimizer as torch_optimizer


class PlainSGD(torch.optim.SGD):
    """torch.optim.SGD (state, param groups, checkpoints: all its own) whose step and zero_grad
    skip the bookkeeping where nothing needs it."""

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None or _hooks(self) or not all(_plain(group) for group in self.param_groups):
            return _hooked(torch.optim.SGD.step)(self, closure)
        with torch.no_grad():
            for group in self.param_groups:
                params = [p for p in group["params"] if p.grad is not None]
                if params:
                    grads = [cast(torch.Tensor, p.grad) for p in params]
                    if group["weight_decay"]:
                        grads = list(torch._foreach_add(grads, params, alpha=group["weight_decay"]))
                    torch._foreach_add_(params, grads, alpha=-group["lr"])
        return None

    # torch wraps an optimizer class's step in its profiler record and hooks unless it is marked
    # as wrapped; this one calls the wrapped step itself where a hook is registered
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            super().zero_grad(set_to_none)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def _plain(group: dict[str, Any]) -> bool:
    """Whether `group`'s step is the one kernel: no momentum, nothing torch's step treats apart."""
    if group["momentum"] or group["maximize"] or group["differentiable"]:
        return False
    return not [p for p in group["params"] if p.grad is not None and p.grad.is_sparse]


def _hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step hook is registered, on `optimizer` or on every optimizer."""
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


def _hooked(step: Callable[..., Any]) -> Callable[..., Any]:
    """torch's `step` with its profiler record and hooks around it (torch adds them to a class's
    step when the first optimizer of that class is made)."""
    return step if getattr(step, "hooked", False) else torch.optim.Optimizer.profile_hook_step(step)
