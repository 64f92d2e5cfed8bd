"""lr_schedule=: the factors by hand, the optimizers' learning rate round by round, and the same
results whatever the transport."""

from __future__ import annotations

import math

import pytest

from helpers import global_weights, quick, train
from splitlab.errors import UserError
from splitlab.resolve import resolve_config
from splitlab.schedules import lr_factor, parse_lr_schedule


def factors(value: str, rounds: int) -> list[float]:
    return [lr_factor(parse_lr_schedule(value), rnd, rounds) for rnd in range(rounds)]


def test_the_factors_by_hand():
    assert factors("none", 3) == [1.0, 1.0, 1.0]
    assert factors("step:2:0.5", 5) == [1.0, 1.0, 0.5, 0.5, 0.25]
    assert factors("warmup:4", 5) == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert factors("cosine", 4) == pytest.approx([1.0, (1 + math.sqrt(0.5)) / 2, 0.5, (1 - math.sqrt(0.5)) / 2])
    assert factors("warmup:2+step:1:0.1", 3) == pytest.approx([0.5, 0.1, 0.01])


@pytest.mark.parametrize("value", ["step:0:0.5", "step:2", "cosine:3", "warmup:1.5", "linear", "step:2:-1"])
def test_a_bad_schedule_is_one_line_naming_what_is_allowed(value):
    with pytest.raises(UserError, match=rf"invalid value '{value}' for lr_schedule: .*step:<every rounds>:<gamma>"):
        resolve_config({"lr_schedule": value})


def test_every_optimizer_steps_with_the_rounds_learning_rate():
    experiment = train(3, **quick(algorithm="sfl_v1", lr_schedule="step:1:0.5", lr=0.01))
    for role in [*experiment.roles.clients, experiment.roles.server]:
        assert role.round == 2
        for optimizer in role.optimizers.values():
            assert [group["lr"] for group in optimizer.param_groups] == [0.01 * 0.25]


def test_a_schedule_changes_training_and_none_changes_nothing():
    base = global_weights(train(2, **quick(algorithm="sfl_v2")))
    none = global_weights(train(2, **quick(algorithm="sfl_v2", lr_schedule="none")))
    scheduled = global_weights(train(2, **quick(algorithm="sfl_v2", lr_schedule="step:1:0.1")))
    assert all(base[k].equal(none[k]) for k in base)
    assert not all(base[k].equal(scheduled[k]) for k in base)


@pytest.mark.parametrize("algorithm", ["sfl_v2", "cse_fsl", "sglr"])
def test_a_schedule_is_bit_identical_whatever_the_transport(algorithm):
    """sglr: personal client parts and a server_lr of its own; cse_fsl: auxiliary heads."""
    config = quick(algorithm=algorithm, rounds=3, lr_schedule="warmup:2+cosine")
    direct, serialized = train(3, **config), train(3, **config, transport="serialized")
    for k in range(3):
        for a, b in zip(direct.algorithm.personal_model(k), serialized.algorithm.personal_model(k)):
            assert a.keys() == b.keys() and all(a[name].equal(b[name]) for name in a)
