"""Partial participation: round(C*K) clients (at least one), seeded per round, honoured by every
algorithm (the centralized reference trains on everyone's data by definition)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import personal_weights, quick
from splitlab.algorithms import algorithm_names
from splitlab.algorithms.base import ClientInfo
from splitlab.engine import build, run
from splitlab.loop import STREAM_SAMPLING, sample_clients
from splitlab.roles import ClientNode


def clients(k: int) -> list[ClientInfo]:
    return [ClientInfo(i, 1) for i in range(k)]


# (C, K, expected): written out by hand, including Python's round-half-to-even (2.5 -> 2).
CASES = [
    (1.0, 10, 10),
    (0.05, 100, 5),
    (0.05, 1129, 56),
    (0.1, 3, 1),
    (0.01, 10, 1),
    (0.5, 1, 1),
    (0.25, 10, 2),
    (0.35, 10, 4),
    (0.3, 10, 3),
    (0.05, 3550, 178),
]


@pytest.mark.parametrize("c,k,expected", CASES)
def test_exactly_round_c_times_k_clients_at_least_one(c, k, expected):
    chosen = sample_clients(clients(k), c, np.random.default_rng(0))
    assert len(chosen) == expected
    ids = [client.id for client in chosen]
    assert ids == sorted(set(ids))


def test_sampling_is_seeded_per_round():
    experiment = build(quick(clients=20))
    ctx = experiment.algorithm.ctx

    def ids(rnd, context=ctx):
        return [c.id for c in sample_clients(experiment.clients, 0.25, context.rng(rnd, STREAM_SAMPLING))]

    assert ids(3) == ids(3)  # same (seed, round): same clients
    assert len({tuple(ids(r)) for r in range(10)}) > 1  # rounds differ
    other = build(quick(clients=20, seed=1)).algorithm.ctx
    assert [ids(r) for r in range(5)] != [ids(r, other) for r in range(5)]


def test_engine_trains_only_the_sampled_clients(tmp_path, monkeypatch):
    seen: list[list[int]] = []
    original = sample_clients

    def recording(clients, participation, rng):
        chosen = original(clients, participation, rng)
        seen.append([c.id for c in chosen])
        return chosen

    monkeypatch.setattr("splitlab.loop.sample_clients", recording)
    run(quick(algorithm="psl", clients=10, participation=0.3, rounds=3, out=str(tmp_path)), progress=False)
    assert [len(ids) for ids in seen] == [3, 3, 3]
    experiment = build(quick(algorithm="psl", clients=10))
    expected = [
        [c.id for c in original(experiment.clients, 0.3, experiment.algorithm.ctx.rng(r, STREAM_SAMPLING))]
        for r in range(3)
    ]
    assert seen == expected


@pytest.mark.parametrize("algorithm", [a for a in algorithm_names() if a != "centralized"])
def test_every_algorithm_touches_only_the_sampled_clients(algorithm, monkeypatch):
    experiment = build(quick(algorithm=algorithm, clients=6))
    used: set[int] = set()
    original = ClientNode.batches

    def recording(self, *args, **kwargs):
        used.add(self.id)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ClientNode, "batches", recording)
    sampled = [experiment.clients[1], experiment.clients[4]]
    experiment.algorithm.run_round(0, sampled)
    assert used == {1, 4}
    if experiment.algorithm.personal_models:
        assert set(personal_weights(experiment)) == {1, 4}
