"""A run's data: only the samples it uses, kept in their stored dtype (uint8 images prepared per
batch), the same float inputs reaching the algorithm as when whole datasets were float32, and the
test set prepared once however often the run evaluates."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from helpers import quick
from splitlab.data import DATASETS, Dataset
from splitlab.data.datasets import Prepared, scale_and_normalize
from splitlab.engine import build, evaluate

NAME = "tiny_uint8"
CALLS: list[int] = []  # the batch size of every `prepare` call


def _counting_prepare(x: torch.Tensor) -> torch.Tensor:
    CALLS.append(len(x))
    return scale_and_normalize(x, mean=(0.3,), std=(0.25,))


def _tiny_uint8(data_dir, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    train_y, test_y = np.arange(400) % 10, np.arange(100) % 10
    return Dataset(NAME, torch.from_numpy(rng.integers(0, 256, (400, 1, 8, 8), dtype=np.uint8)),
                   torch.from_numpy(train_y), torch.from_numpy(rng.integers(0, 256, (100, 1, 8, 8), dtype=np.uint8)),
                   torch.from_numpy(test_y), 10, (1, 8, 8), prepare=_counting_prepare)


@pytest.fixture(autouse=True)
def tiny_uint8(monkeypatch):
    monkeypatch.setitem(DATASETS, NAME, _tiny_uint8)
    CALLS.clear()


def config(**overrides) -> dict:
    return quick(dataset=NAME, train_subset=60, clients=3, **overrides)


def test_the_run_holds_only_its_clients_samples_in_their_stored_dtype():
    experiment = build(config())
    x = experiment.data.train_x
    assert isinstance(x, Prepared) and x.stored.dtype == torch.uint8 and x.dtype == torch.float32
    assert len(x.stored) == len(experiment.data.train_y) == 60 == sum(c.num_samples for c in experiment.clients)
    whole = build(config(), all_train_samples=True)
    assert len(whole.data.train_x.stored) == 400


def test_held_out_client_samples_are_kept_too():
    experiment = build(config(test_split="client:0.25"))
    assert len(experiment.data.train_x) == 60
    assert sum(c.num_samples for c in experiment.clients) + sum(len(t) for t in experiment.client_test) == 60


@pytest.mark.parametrize("extra", [{}, {"test_split": "client:0.25"}])
def test_batches_reaching_the_algorithm_are_the_same_floats_as_with_the_whole_dataset(extra):
    """Compacting to the used samples renumbers them; every client's batches keep their values."""
    compact, whole = build(config(**extra)), build(config(**extra), all_train_samples=True)
    for a, b in zip(compact.clients, whole.clients):
        for (xa, ya), (xb, yb) in zip(compact.algorithm.ctx.batches(a, 0), whole.algorithm.ctx.batches(b, 0)):
            assert xa.dtype == torch.float32 and torch.equal(xa, xb) and torch.equal(ya, yb)
    # and those are the float32 values of converting the stored rows at once
    stored = _tiny_uint8(None, 0).train_x
    expected = stored.float().div_(255.0).sub_(0.3).div_(0.25)
    assert torch.equal(whole.data.train_x[torch.arange(400)], expected)


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


def test_a_strided_training_set_is_kept_whole_not_gathered():
    """Shakespeare-like windows over one stream: gathering rows would copy every window."""
    stream = torch.arange(50, dtype=torch.uint8)
    windows = stream.unfold(0, 8, 1)  # 43 windows of 8, a view
    ds = Dataset("windows", windows, torch.zeros(len(windows), dtype=torch.int64), windows[:3].clone(),
                 torch.zeros(3, dtype=torch.int64), 2, (8,))
    view, kept = ds.for_run(np.array([2, 5, 9]), np.arange(3), torch.device("cpu"))
    assert kept.tolist() == list(range(43)) and view.train_x.untyped_storage().nbytes() == 50
    compact, kept = Dataset("rows", windows.contiguous(), ds.train_y, ds.test_x, ds.test_y, 2, (8,)).for_run(
        np.array([2, 5, 9]), np.arange(3), torch.device("cpu"))
    assert kept.tolist() == [2, 5, 9] and torch.equal(compact.train_x, windows[[2, 5, 9]])
