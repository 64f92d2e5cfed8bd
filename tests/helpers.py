"""Small shared test helpers: quick configs and weight comparisons."""

from __future__ import annotations

import torch

from splitlab.engine import Experiment, build

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
