"""Test metrics of a task: classification (accuracy, loss, macro-F1, MCC) or language (token
accuracy, masked loss, perplexity).

F1 and MCC are computed from the confusion matrix with scikit-learn's formulas (`f1_score(average=
"macro", zero_division=0)`, `matthews_corrcoef`) rather than by importing it: scikit-learn pulls in
SciPy, a second of startup and tens of MB of memory for every run.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from splitlab.targets import IGNORED


@torch.no_grad()
def logits_in_batches(
    predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, batch_size: int
) -> torch.Tensor:
    return torch.cat([predict(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])


def classification_metrics(logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    loss = float(F.cross_entropy(logits.float(), y))
    predicted = logits.argmax(dim=1).cpu().numpy()
    truth = y.cpu().numpy()
    return {
        "accuracy": float(np.mean(predicted == truth)),
        "loss": loss,
        "f1": macro_f1(truth, predicted),
        "mcc": matthews(truth, predicted),
    }


def language_metrics(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Over every target token in the loss (targets != IGNORED): the fraction
    predicted exactly (argmax), the mean cross-entropy, and the perplexity exp(loss)."""
    counted = targets != IGNORED
    loss = float(F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten()))
    correct = (logits.argmax(dim=-1) == targets) & counted
    return {
        "accuracy": float(correct.sum() / counted.sum()),
        "loss": loss,
        "perplexity": math.exp(min(loss, 700.0)),  # exp overflows a float beyond ~709
    }


#: task -> metrics(logits, targets), keyed by `Dataset.task`
TASK_METRICS: dict[str, Callable[[torch.Tensor, torch.Tensor], dict[str, float]]] = {
    "classification": classification_metrics,
    "language": language_metrics,
}


def _confusion(truth: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    """Confusion matrix over the labels seen in either array (rows: truth), as scikit-learn's."""
    labels, codes = np.unique(np.concatenate([truth, predicted]), return_inverse=True)
    n = len(labels)
    return np.bincount(codes[: len(truth)] * n + codes[len(truth) :], minlength=n * n).reshape(n, n)


def macro_f1(truth: np.ndarray, predicted: np.ndarray) -> float:
    """Unweighted mean over labels of 2 tp / (2 tp + fp + fn), 0 where that is 0 / 0."""
    c = _confusion(truth, predicted)
    tp, denominator = np.diag(c).astype(np.float64), (c.sum(1) + c.sum(0)).astype(np.float64)
    return float(np.mean(np.divide(2 * tp, denominator, out=np.zeros_like(tp), where=denominator != 0)))


def matthews(truth: np.ndarray, predicted: np.ndarray) -> float:
    """Multiclass Matthews correlation coefficient (Gorodkin's R_K), 0 when undefined."""
    c = _confusion(truth, predicted)
    t_sum, p_sum = c.sum(1, dtype=np.float64), c.sum(0, dtype=np.float64)
    n_correct, n_samples = np.trace(c, dtype=np.float64), p_sum.sum()
    cov_ytyp = n_correct * n_samples - np.dot(t_sum, p_sum)
    cov_ypyp_ytyt = (n_samples**2 - np.dot(p_sum, p_sum)) * (n_samples**2 - np.dot(t_sum, t_sum))
    return 0.0 if cov_ypyp_ytyt == 0 else float(cov_ytyp / np.sqrt(cov_ypyp_ytyt))
