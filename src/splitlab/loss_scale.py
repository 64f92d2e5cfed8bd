"""`precision=fp16`'s dynamic loss scaling: one `LossScale` per role that trains, on what it trains.

float16 keeps 5 exponent bits: gradients below 6e-8 flush to zero. Each role therefore multiplies
every seed of its backward pass (a loss, or a gradient it received) by its scale S, so that what
flows through the half-precision graph is S times larger, and divides its parameters' gradients
(float32 master weights) by S before its optimizer steps. A step whose gradients are not finite
is skipped and S halves; after `GROWTH_INTERVAL` finite steps in a row S doubles: the rule and
defaults of `torch.amp.GradScaler`, kept here as two numbers because the cut gradient's
finiteness joins the decision and the scale crosses the cut beside it (docs/performance.md).

The cut gradient a training server sends is its scaled gradient at the cut, in float16 (2 bytes
per value), with the scale S it was computed under (`scaled`: 4 more bytes); the client reads it
back unscaled, in float32 (`unscaled`), and seeds its own backward pass with its own scale. A
server step that overflowed sends zeros with scale 0: nothing non-finite crosses, and the client
skips that step too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from splitlab.privacy.defenses import decode

#: torch.amp.GradScaler's defaults: a power of two, so scaling and unscaling are exact
INITIAL_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class LossScale:
    """One role's dynamic loss scale and its count of finite steps since it last changed."""

    def __init__(self) -> None:
        self.scale = INITIAL_SCALE
        self.finite_steps = 0
        #: the scale the last step's gradients were computed under; 0 if that step was skipped
        self.used = INITIAL_SCALE

    def seed(self, tensor: torch.Tensor, grad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A (tensor, gradient) pair of a backward pass, scaled: a loss times S, a gradient times S
        in the tensor's dtype (a gradient that overflows there makes the step skip)."""
        if grad is None:
            return tensor * self.scale, None
        return tensor, (grad.float() * self.scale).to(tensor.dtype)

    def unscale(self, grads: Sequence[torch.Tensor], sent: Sequence[torch.Tensor] = ()) -> bool:
        """Divide `grads` (the parameters' gradients) by S in place; whether they and `sent` (the
        scaled cut gradients that will cross) are all finite. Then the scale follows: a step not
        finite is to be skipped and halves it; `GROWTH_INTERVAL` finite ones double it. One sync."""
        if grads:
            torch._foreach_mul_(list(grads), 1.0 / self.scale)
        finite = self.crossing([*grads, *sent])
        if finite:
            self.finite_steps += 1
            if self.finite_steps == GROWTH_INTERVAL:
                self.scale, self.finite_steps = self.scale * GROWTH_FACTOR, 0
        return finite

    def crossing(self, grads: Sequence[torch.Tensor]) -> bool:
        """Whether scaled gradients about to cross (and decide a step) are finite; if not, the step
        is skipped (`used` 0, what crosses is zeros) and S halves. One sync."""
        self.used = self.scale
        checked = [torch.isfinite(g).all() for g in grads]
        if not checked or bool(torch.stack(checked).all()):
            return True
        self.skip()
        self.scale, self.finite_steps = self.scale * BACKOFF_FACTOR, 0
        return False

    def skip(self) -> None:
        """This step is not taken, here or (scale 0 crossing) on the other side: nothing of it crosses."""
        self.used = 0.0

    def state(self) -> torch.Tensor:
        """(scale, finite steps) for a checkpoint: a resumed run scales as the straight one."""
        return torch.tensor([self.scale, self.finite_steps], dtype=torch.float64)

    def load(self, state: torch.Tensor) -> None:
        self.scale, self.finite_steps = float(state[0]), int(state[1])
        self.used = self.scale


def scaled(wire: Any, scale: float, device: torch.device) -> dict[str, Any]:
    """A cut gradient as it crosses under fp16: its wire form (scaled by `scale`) and the scale."""
    return {"grad": wire, "scale": torch.tensor(scale, dtype=torch.float32, device=device)}


def outgoing(grad: torch.Tensor, loss_scale: LossScale) -> torch.Tensor:
    """`grad`, computed under `loss_scale`'s last step, as it may cross: zeros if that step was skipped."""
    return grad if loss_scale.used else torch.zeros_like(grad)


def unscaled(message: Any) -> torch.Tensor | None:
    """A received `scaled` cut gradient in float32, divided by its scale, every part checked; None
    when the sender skipped the step (scale 0)."""
    if not isinstance(message, Mapping) or set(message) != {"grad", "scale"}:
        raise ValueError("under precision=fp16 a cut gradient must come as its scaled value and its scale")
    scale = message["scale"]
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.dim() != 0:
        raise ValueError("a cut gradient's scale must be a float32 scalar")
    value = float(scale)
    if not (value >= 0 and value < float("inf")):
        raise ValueError(f"a cut gradient's scale must be finite and not negative, not {value}")
    grad = decode(message["grad"])
    if not bool(torch.isfinite(grad).all()):
        raise ValueError("a scaled cut gradient holds values that are not finite")
    return None if value == 0 else grad.float() / value
