"""loss=: each loss by hand, the default bit for bit as before losses had names, the language
task's mask, one-line refusals, and a plugin's loss reaching every role whatever the transport."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import splitlab
from helpers import global_weights, quick, train
from splitlab.errors import UserError
from splitlab.losses import LOSSES, Loss, parse_loss
from splitlab.resolve import resolve_config
from splitlab.targets import IGNORED

# one sample, two classes, p = softmax([0, ln 3]) = (1/4, 3/4), target class 1
LOGITS, TARGET = torch.tensor([[0.0, math.log(3.0)]], dtype=torch.float64), torch.tensor([1])


def test_each_loss_by_hand():
    assert float(parse_loss("cross_entropy")(LOGITS, TARGET)) == pytest.approx(-math.log(0.75), rel=1e-12)
    # smoothed target (1 - 0.1) * (0, 1) + 0.1 / 2 = (0.05, 0.95)
    smoothed = -(0.05 * math.log(0.25) + 0.95 * math.log(0.75))
    assert float(parse_loss("label_smoothing:0.1")(LOGITS, TARGET)) == pytest.approx(smoothed, rel=1e-12)
    # (1 - p_t) ** gamma * -log p_t with p_t = 3/4
    assert float(parse_loss("focal:2")(LOGITS, TARGET)) == pytest.approx(0.25**2 * -math.log(0.75), rel=1e-12)


def test_the_default_is_the_cross_entropy_of_before_bit_for_bit():
    """What roles.loss and roles.weighted_loss computed before `loss=` existed, for both tasks."""
    generator = torch.Generator().manual_seed(0)
    default = parse_loss(resolve_config({}).run.loss)
    for logits, targets in (
        (torch.randn(7, 5, generator=generator), torch.tensor([0, 4, 1, 1, 2, 3, 0])),
        (torch.randn(2, 3, 5, generator=generator), torch.tensor([[IGNORED, 1, 4], [IGNORED, IGNORED, 0]])),
    ):
        flat_logits, flat_targets = logits.flatten(0, -2), targets.flatten()
        before = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORED)
        assert torch.equal(default(logits, targets), before)
        weight = torch.rand(len(targets), generator=generator)
        per_target = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORED, reduction="none")
        counted = weight.view(-1, *[1] * (targets.dim() - 1)) * (targets != IGNORED)
        weighted_before = (per_target * counted.flatten()).sum() / counted.sum()
        assert torch.equal(default.weighted(logits, targets, weight), weighted_before)


def test_a_language_batch_leaves_the_positions_outside_the_loss_out():
    """Tokens at IGNORED positions add nothing (whatever their logits), and each token in the loss
    weighs the same: the mean of the one-sample losses of the counted positions."""
    logits = torch.tensor([[[0.0, math.log(3.0)], [1e4, -1e4], [2.0, 0.0]]], dtype=torch.float64)
    targets = torch.tensor([[1, IGNORED, 0]])
    for name in ("label_smoothing:0.2", "focal:1.5"):
        by_sample = parse_loss(name)
        expected = (by_sample(logits[0, :1], targets[0, :1]) + by_sample(logits[0, 2:], targets[0, 2:])) / 2
        assert float(by_sample(logits, targets)) == pytest.approx(float(expected), rel=1e-12)
        weighted = by_sample.weighted(
            torch.cat([logits, logits]), torch.cat([targets, targets]), torch.tensor([1.0, 3.0])
        )
        assert float(weighted) == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("hinge", "unknown loss 'hinge'; expected one of cross_entropy, label_smoothing:<eps>, focal:<gamma>"),
        ("focal", "'focal' is not focal:<gamma>"),
        ("focal:x", "'focal:x' is not focal:<gamma>"),
        ("label_smoothing:1", "'label_smoothing:1': eps must be at least 0 and below 1"),
        ("focal:nan", "'focal:nan': gamma must be between 0 and 100"),
        ("cross_entropy:0.1", "'cross_entropy:0.1' is not cross_entropy"),
    ],
)
def test_a_bad_loss_is_one_line_naming_what_is_allowed(value, says):
    with pytest.raises(UserError, match=f"^invalid value '{value}' for loss: {re.escape(says)}"):
        resolve_config({"loss": value})


@pytest.fixture
def scaled_loss():
    """A plugin's loss: k times the cross-entropy terms."""
    splitlab.register_loss(
        "scaled", lambda k: Loss(lambda logits, y: k * F.cross_entropy(logits, y, reduction="none")), "scaled:<k>"
    )
    yield
    del LOSSES.entries["scaled"]


@pytest.mark.parametrize("algorithm", ["fedavg", "cse_fsl", "cycle_sfl"])
def test_a_plugins_loss_reaches_every_role_whatever_the_transport(algorithm, scaled_loss):
    """Twice the loss under SGD is twice the learning rate, bit for bit, only if every loss of the
    run (client steps, auxiliary heads, server steps, CycleSL's weighted pooled batches and cut
    gradients) is the configured one."""
    config = quick(algorithm=algorithm, optimizer="sgd", lr=0.05)
    doubled = global_weights(train(2, **config, loss="scaled:2", transport="serialized"))
    twice_the_lr = global_weights(train(2, **{**config, "lr": 0.1}, loss="scaled:1"))
    assert doubled.keys() == twice_the_lr.keys() and all(doubled[k].equal(twice_the_lr[k]) for k in doubled)
    plain = global_weights(train(2, **config))
    assert not all(doubled[k].equal(plain[k]) for k in doubled)


def test_a_built_in_loss_cannot_be_replaced():
    with pytest.raises(UserError, match="cannot register loss 'focal'"):
        splitlab.register_loss("focal", lambda: Loss(lambda logits, y: logits.sum(-1)))
