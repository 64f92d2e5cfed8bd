"""Small shared test helpers: quick configs and weight comparisons."""

from __future__ import annotations

import io

import torch

from splitlab.algorithms.base import STREAM_SAMPLING
from splitlab.engine import Experiment, build, sample_clients

QUICK = dict(dataset="synthetic", model="mlp", clients=3, rounds=2, batch_size=32, device="cpu",
             train_subset=300, seed=0)


def quick(**overrides) -> dict:
    return {**QUICK, **overrides}


def train(num_rounds: int, **config) -> Experiment:
    """Build an experiment and train it for `num_rounds` rounds on all clients (no files written)."""
    experiment = build(config)
    for rnd in range(num_rounds):
        experiment.algorithm.train_round(rnd, experiment.clients)
    return experiment


def global_weights(experiment: Experiment) -> dict[str, torch.Tensor]:
    return {name: t for part in experiment.algorithm.global_parts() for name, t in part.state_dict().items()}


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def straight_and_resumed(num_rounds: int, **config) -> tuple[Experiment, Experiment]:
    """Train `num_rounds` rounds straight through, and again with the algorithm's state saved and
    loaded into a fresh experiment before the last round (as the engine's checkpoint does)."""

    def step(experiment: Experiment, rnd: int) -> None:
        torch.manual_seed(rnd)
        rng = experiment.algorithm.ctx.rng(rnd, STREAM_SAMPLING)
        experiment.algorithm.train_round(rnd, sample_clients(experiment.clients, config.get("participation", 1.0), rng))

    straight, first, resumed = build(config), build(config), build(config)
    for rnd in range(num_rounds):
        step(straight, rnd)
    for rnd in range(num_rounds - 1):
        step(first, rnd)
    buffer = io.BytesIO()
    torch.save(first.algorithm.state_dict(), buffer)
    buffer.seek(0)
    resumed.algorithm.load_state_dict(torch.load(buffer, weights_only=True))
    step(resumed, num_rounds - 1)
    return straight, resumed
