"""augment=: flip and crop by hand, the same batches from the same seed (and only training batches
changed), resume and transports bit for bit, and one-line refusals for samples that are not images."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from helpers import global_weights, node, quick, straight_and_resumed, train
from splitlab.augment import check_augment, parse_augment
from splitlab.cli import main
from splitlab.engine import build
from splitlab.errors import UserError
from splitlab.resolve import resolve_config


def test_flip_and_crop_by_hand():
    x = torch.arange(2 * 1 * 3 * 3, dtype=torch.uint8).view(2, 1, 3, 3)
    (flip,) = parse_augment("flip")
    draws = np.random.default_rng(7).integers(0, 2, 2, dtype=bool)
    flipped = flip.apply(x, np.random.default_rng(7))
    for i, mirrored in enumerate(draws):
        assert torch.equal(flipped[i], x[i].flip(-1) if mirrored else x[i])

    (crop,) = parse_augment("crop:1")
    draws = np.random.default_rng(3)
    top, left = draws.integers(0, 3, 2), draws.integers(0, 3, 2)
    cropped = crop.apply(x, np.random.default_rng(3))
    padded = torch.zeros(2, 1, 5, 5, dtype=torch.uint8)
    padded[:, :, 1:4, 1:4] = x
    assert cropped.dtype == torch.uint8 and cropped.shape == x.shape
    for i in range(2):
        assert torch.equal(cropped[i], padded[i, :, top[i] : top[i] + 3, left[i] : left[i] + 3])


def batches(experiment, client: int, rnd: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(node(experiment, client).batches(rnd))


def test_the_same_seed_draws_the_same_augmented_batches_and_only_the_inputs_change():
    config = quick(augment="crop:2+flip", local_epochs=2)
    first, second, plain = build(config), build(config), build(quick(local_epochs=2))
    for rnd in (0, 1):
        ours, again, unaugmented = batches(first, 1, rnd), batches(second, 1, rnd), batches(plain, 1, rnd)
        assert len(ours) == len(unaugmented) > 2
        for (x, y), (x2, y2), (x0, y0) in zip(ours, again, unaugmented):
            assert torch.equal(x, x2) and torch.equal(y, y2) and torch.equal(y, y0)  # same samples, same order
            assert not torch.equal(x, x0)
    assert not torch.equal(batches(first, 1, 0)[0][0], batches(first, 1, 1)[0][0])  # each round its own draws
    assert not torch.equal(batches(first, 1, 0)[0][0], batches(first, 2, 0)[0][0][: len(batches(first, 1, 0)[0][0])])


def test_evaluation_samples_are_untouched():
    """The global test set and every client's held-out samples are those of a run without augment."""
    config = quick(test_split="client:0.2")
    augmented, plain = build({**config, "augment": "crop:3+flip"}), build(config)
    assert torch.equal(augmented.data.test_x, plain.data.test_x)
    assert augmented.client_test is not None and plain.client_test is not None
    for (x, y), (x0, y0) in zip(augmented.client_test, plain.client_test):
        assert torch.equal(x, x0) and torch.equal(y, y0)


@pytest.mark.parametrize("algorithm", ["fedavg", "sfl_v2"])
def test_resumed_and_serialized_runs_are_bit_identical(algorithm):
    config = quick(algorithm=algorithm, augment="flip+crop:1")
    straight, resumed = straight_and_resumed(2, **config)
    a, b = global_weights(straight), global_weights(resumed)
    assert all(a[k].equal(b[k]) for k in a)
    serialized = global_weights(train(2, **config, transport="serialized"))
    assert all(a[k].equal(serialized[k]) for k in a)
    assert not all(a[k].equal(v) for k, v in global_weights(train(2, **{**config, "augment": "none"})).items())


@pytest.mark.parametrize(
    ("dataset", "shape", "task", "says"),
    [
        ("shakespeare", (80,), "classification", "shakespeare's samples are of shape (80,)"),
        ("e2e", (128,), "language", "e2e's samples are token sequences"),
    ],
)
def test_samples_that_are_not_images_refuse_it(dataset, shape, task, says):
    with pytest.raises(UserError, match="^" + re.escape(f"augment=flip transforms images (samples C x H x W); {says}")):
        check_augment("flip", dataset, shape, task)
    check_augment("none", dataset, shape, task)


def test_the_cli_refuses_a_table_in_one_line(tmp_path, capsys, monkeypatch):
    import splitlab
    from splitlab.data import datasets

    def table(data_dir, seed):
        x, y = torch.randn(40, 6), torch.arange(40) % 2
        return datasets.Dataset("table", x[:30], y[:30], x[30:], y[30:], 2, (6,))

    monkeypatch.setattr(datasets, "DATASETS", dict(datasets.DATASETS))
    splitlab.register_dataset("table", table)
    assert main(["run", "dataset=table", "model=mlp", "augment=crop:2", f"out={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "augment=crop:2 transforms images" in err and "shape (6,)" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("value", "says"), [("rotate", "unknown augmentation 'rotate'"), ("crop:0", "pad must be"), ("flip:2", "not flip")]
)
def test_a_bad_augment_is_one_line(value, says):
    with pytest.raises(UserError, match=f"^invalid value '{value}' for augment: .*{says}"):
        resolve_config({"augment": value})
