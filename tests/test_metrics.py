"""splitlab's macro-F1 and MCC match scikit-learn's, which it no longer imports at run time."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import f1_score, matthews_corrcoef

from splitlab.metrics import macro_f1, matthews


@pytest.mark.parametrize("seed", range(20))
def test_f1_and_mcc_match_scikit_learn(seed):
    rng = np.random.default_rng(seed)
    classes = int(rng.integers(1, 12))
    truth = rng.integers(0, classes, int(rng.integers(1, 300)))
    predicted = np.where(rng.random(len(truth)) < 0.6, truth, rng.integers(0, classes + 2, len(truth)))
    assert macro_f1(truth, predicted) == pytest.approx(
        f1_score(truth, predicted, average="macro", zero_division=0), rel=1e-12, abs=1e-15
    )
    assert matthews(truth, predicted) == pytest.approx(matthews_corrcoef(truth, predicted), rel=1e-12, abs=1e-15)


@pytest.mark.filterwarnings("ignore:A single label was found")
@pytest.mark.parametrize("truth, predicted", [([3, 3, 3], [3, 3, 3]), ([1, 1], [2, 2]), ([0], [1]), ([0, 1], [1, 0])])
def test_degenerate_cases_match_scikit_learn(truth, predicted):
    truth, predicted = np.array(truth), np.array(predicted)
    assert macro_f1(truth, predicted) == f1_score(truth, predicted, average="macro", zero_division=0)
    assert matthews(truth, predicted) == matthews_corrcoef(truth, predicted)
