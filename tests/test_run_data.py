"""A run's data: each client node holds only its samples, in their stored dtype (uint8 images
prepared per batch), the same float inputs reaching the algorithm as when whole datasets were
float32, and the test set prepared once however often the run evaluates."""

from __future__ import annotations

import functools
import gc

import numpy as np
import pytest
import torch

from helpers import global_weights, quick
from splitlab.data import DATASETS, Dataset
from splitlab.data.datasets import Prepared, scale_and_normalize
from splitlab.engine import build
from splitlab.loop import evaluate
from splitlab.roles import STREAM_BATCHES

NAME = "tiny_uint8"
CALLS: list[int] = []  # the batch size of every `prepare` call


def _counting_prepare(x: torch.Tensor) -> torch.Tensor:
    CALLS.append(len(x))
    return scale_and_normalize(x, mean=(0.3,), std=(0.25,))


def _tiny_uint8(data_dir, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    train_y, test_y = np.arange(400) % 10, np.arange(100) % 10
    return Dataset(
        NAME,
        torch.from_numpy(rng.integers(0, 256, (400, 1, 8, 8), dtype=np.uint8)),
        torch.from_numpy(train_y),
        torch.from_numpy(rng.integers(0, 256, (100, 1, 8, 8), dtype=np.uint8)),
        torch.from_numpy(test_y),
        10,
        (1, 8, 8),
        prepare=_counting_prepare,
    )


@pytest.fixture(autouse=True)
def tiny_uint8(monkeypatch):
    monkeypatch.setitem(DATASETS, NAME, _tiny_uint8)
    CALLS.clear()


def config(**overrides) -> dict:
    return quick(dataset=NAME, train_subset=60, clients=3, **overrides)


def test_each_client_node_holds_only_its_samples_in_their_stored_dtype():
    experiment = build(config())
    nodes = experiment.roles.clients
    assert all(node.x.dtype == torch.uint8 for node in nodes)
    assert sum(len(node.x) for node in nodes) == 60 and len(experiment.data.train_x) == 0


def test_held_out_client_samples_are_the_rest_of_the_clients_samples():
    experiment = build(config(test_split="client:0.25"))
    held = sum(len(y) for _, y in experiment.client_test)
    assert sum(len(node.x) for node in experiment.roles.clients) + held == 60 and held > 0


def test_batches_reaching_the_algorithm_are_the_float32_values_of_the_stored_rows():
    experiment = build(config())
    for node in experiment.roles.clients:
        order = experiment.blueprint.rng(0, STREAM_BATCHES, node.id, 0).permutation(node.num_samples)
        expected = node.x.float().div_(255.0).sub_(0.3).div_(0.25)[torch.as_tensor(order)]
        batches = list(node.batches(0))
        assert all(x.dtype == torch.float32 for x, _ in batches)
        assert torch.equal(torch.cat([x for x, _ in batches]), expected)
        assert torch.equal(torch.cat([y for _, y in batches]), node.y[torch.as_tensor(order)])


def test_the_test_set_is_prepared_once_whatever_the_number_of_evaluations():
    experiment = build(config(test_subset=40))
    assert CALLS.count(40) == 1 and experiment.data.test_x.dtype == torch.float32
    calls = len(CALLS)
    first = evaluate(experiment)
    assert evaluate(experiment) == first and len(CALLS) == calls


def test_held_out_client_samples_are_prepared_once():
    experiment = build(config(test_split="client:0.25"))
    first = evaluate(experiment)
    calls = len(CALLS)
    assert evaluate(experiment) == first and len(CALLS) == calls


def test_prepared_answers_like_a_tensor_of_the_inputs():
    stored = torch.arange(2 * 3 * 4, dtype=torch.uint8).view(2, 1, 3, 4)
    x = Prepared(stored, functools.partial(scale_and_normalize, mean=(0.5,), std=(0.5,)))
    assert len(x) == 2 and x.shape == (2, 1, 3, 4) and x.dtype == torch.float32 and x.element_size() == 4
    assert x.device == stored.device and x.to("cpu").stored is not None
    assert torch.equal(x[torch.tensor([1])], (stored[1:].float() / 255 - 0.5) / 0.5)


def test_client_samples_are_prepared_once_a_run_within_the_budget_and_each_visit_beyond_it(monkeypatch):
    """Kept prepared (the budget allows), a client visited again prepares nothing; beyond the
    budget it prepares its samples at each visit: the same weights either way."""

    def trained():
        experiment = build(config(algorithm="fedavg"))
        CALLS.clear()  # the test set's and the checks', when the run is built
        for rnd in range(3):
            experiment.algorithm.run_round(rnd, experiment.clients)
        return experiment

    kept = trained()
    client_sizes = sorted(node.num_samples for node in kept.roles.clients)
    assert sorted(CALLS) == client_sizes  # each client's samples, once in 3 rounds
    assert all(node._prepared is not None for node in kept.roles.clients)
    monkeypatch.setattr("splitlab.roles.PREPARED_BUDGET", 0)
    again = trained()
    assert sorted(CALLS) == sorted(client_sizes * 3)
    assert all(node._prepared is None for node in again.roles.clients)
    for name, weight in global_weights(kept).items():
        assert torch.equal(weight, global_weights(again)[name])


def test_a_client_gone_gives_its_prepared_samples_budget_back(monkeypatch):
    """What a client keeps counts against its process's budget while it lives (on Ray, a client
    moving to another actor leaves this one's budget)."""
    blueprint = build(config(algorithm="fedavg")).blueprint
    monkeypatch.setattr("splitlab.roles.PREPARED_BUDGET", blueprint._prepared_bytes + 1000)

    class Client:
        pass

    first, second = Client(), Client()
    assert blueprint.keep_prepared(first, torch.zeros(150))  # 600 bytes
    assert not blueprint.keep_prepared(second, torch.zeros(150))  # 1,200 would be over
    del first
    gc.collect()
    assert blueprint.keep_prepared(second, torch.zeros(150))
