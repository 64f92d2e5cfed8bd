"""PlainSGD takes torch.optim.SGD's steps bit for bit, only without its per-step bookkeeping."""

from __future__ import annotations

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from splitlab.optimizers import PlainSGD


def train(optimizer_class: type[torch.optim.SGD], **settings: float) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)  # a parameter without a gradient is left as it is
    optimizer = optimizer_class([p for p in model.parameters()], lr=0.1, foreach=True, **settings)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        optimizer.zero_grad(set_to_none=True)
        x, y = torch.randn(8, 5, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.param_groups[0]["lr"] = 0.1 / (step + 1)  # a schedule sets the rate between steps
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "settings", [{}, {"weight_decay": 0.01}, {"momentum": 0.9}, {"momentum": 0.9, "nesterov": True}]
)
def test_plain_sgd_steps_as_torch_does_bit_for_bit(settings):
    for ours, theirs in zip(train(PlainSGD, **settings), train(torch.optim.SGD, **settings), strict=True):
        assert torch.equal(ours, theirs)


def test_zero_grad_clears_and_keeps_zeros_when_asked():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = PlainSGD([weight], lr=0.1)
    weight.sum().backward()
    optimizer.zero_grad(set_to_none=False)
    assert torch.equal(weight.grad, torch.zeros(3))
    optimizer.zero_grad()
    assert weight.grad is None


def test_a_closure_is_torch_s_step():
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = PlainSGD([weight], lr=0.5)

    def closure() -> float:
        optimizer.zero_grad()
        loss = (weight**2).sum()
        loss.backward()
        return float(loss.detach())

    assert optimizer.step(closure) == 2.0
    assert torch.equal(weight.detach(), torch.zeros(2))


def test_step_hooks_run_as_torch_runs_them():
    """A registered hook (its own or every optimizer's) is honoured: the step is torch's, hooks and all."""
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = PlainSGD([weight], lr=0.5)
    seen = []
    own = optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("own"))
    everyone = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append("all"))
    try:
        weight.sum().backward()
        optimizer.step()
    finally:
        own.remove()
        everyone.remove()
    assert seen == ["all", "own"]
    assert torch.equal(weight.detach(), torch.full((2,), 0.5))
