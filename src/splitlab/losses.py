"""Training losses by name: `loss=NAME[:ARG...]`, a registry a plugin can add to (`splitlab.register_loss`).

    cross_entropy          the default
    label_smoothing:<eps>  cross-entropy against (1 - eps) * one-hot + eps / classes
    focal:<gamma>          -(1 - p_t) ** gamma * log p_t (Lin et al. 2017); focal:0 is cross-entropy

A loss is defined by its per-target terms (logits (N, C), targets (N,) -> (N,)); every target equal
to IGNORED (a language task's context and padding) is left out, so the same loss serves both tasks:
a batch's loss is the mean of its terms over the targets in the loss, and `weighted` weighs each
sample's terms (CycleSL's pooled batches). Every role takes the run's loss from its blueprint, so
it is the same whatever the transport. Evaluation still reports cross-entropy (and perplexity).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from splitlab.named_options import Registry
from splitlab.targets import IGNORED

Terms = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(logits (N, C), targets (N,), each a class) -> the loss of each target (N,)."""


class Loss:
    """The mean of `terms` over the targets that are not IGNORED, of any batch shape:
    per sample for classification (logits (B, C), targets (B,)), per token for a language task
    (logits (B, T, V), targets (B, T))."""

    def __init__(self, terms: Terms) -> None:
        self.terms = terms

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        counted = targets.flatten() != IGNORED
        return (self._masked_terms(logits, targets, counted)).sum() / counted.sum()

    def weighted(
        self, logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, total: float | None = None
    ) -> torch.Tensor:
        """The loss with every sample's terms weighted by `weight` (B,): sum w l / sum w over the targets
        in the loss (per token for a language task, each token weighted by its sample's weight).
        `total` replaces the denominator: these samples are part of a larger batch whose sum of
        weights it is (a client's share of a U-shaped CycleSL server batch)."""
        counted = (weight.view(-1, *[1] * (targets.dim() - 1)) * (targets != IGNORED)).flatten()
        value = (self._masked_terms(logits, targets, counted != 0) * counted).sum()
        return value / (counted.sum() if total is None else total)

    def _masked_terms(self, logits: torch.Tensor, targets: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
        """The terms, 0 where a target is not counted (an ignored target is given class 0 first, so
        that `terms` only ever sees classes)."""
        targets = targets.flatten()
        return torch.where(counted, self.terms(logits.flatten(0, -2), torch.where(counted, targets, 0)), 0.0)


class CrossEntropy(Loss):
    """The default, computed as torch computes it (its mean reduction, bit for bit as before losses had names)."""

    def __init__(self) -> None:
        super().__init__(lambda logits, targets: F.cross_entropy(logits, targets, reduction="none"))

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORED)


def _label_smoothing(eps: float) -> Loss:
    if not 0 <= eps < 1:
        raise ValueError("eps must be at least 0 and below 1")
    return Loss(lambda logits, targets: F.cross_entropy(logits, targets, reduction="none", label_smoothing=eps))


def _focal(gamma: float) -> Loss:
    if not 0 <= gamma <= 100:
        raise ValueError("gamma must be between 0 and 100")

    def terms(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        log_p = F.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
        return -((1 - log_p.exp()) ** gamma) * log_p

    return Loss(terms)


#: `loss=name:1:2` trains with make(1.0, 2.0)
LOSSES: Registry[Loss] = Registry(
    "loss",
    {
        "cross_entropy": (CrossEntropy, "cross_entropy"),
        "label_smoothing": (_label_smoothing, "label_smoothing:<eps>"),
        "focal": (_focal, "focal:<gamma>"),
    },
)


def register_loss(name: str, make: Callable[..., Loss], form: str | None = None) -> None:
    """Make `loss=name[:a[:b...]]` train with `make(a, b, ...)` (the numbers as floats), a `Loss`
    built from per-target terms; `form` shows its arguments in messages (e.g. "mine:<alpha>").
    A plugin's name may be registered again (the later one counts), a built-in one may not."""
    LOSSES.register(name, make, form)


def parse_loss(value: str) -> Loss:
    """The loss `value` names; ValueError saying what is allowed."""
    return LOSSES.make(value)
