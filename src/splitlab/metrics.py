"""Test metrics: accuracy, loss, macro-F1 and MCC (the last two from scikit-learn)."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.metrics import f1_score, matthews_corrcoef


@torch.no_grad()
def logits_in_batches(predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                      batch_size: int = 1024) -> torch.Tensor:
    return torch.cat([predict(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])


def classification_metrics(logits: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    loss = float(F.cross_entropy(logits.float(), y))
    predicted = logits.argmax(dim=1).cpu().numpy()
    truth = y.cpu().numpy()
    return {
        "accuracy": float(np.mean(predicted == truth)),
        "loss": loss,
        "f1": float(f1_score(truth, predicted, average="macro", zero_division=0)),
        "mcc": float(matthews_corrcoef(truth, predicted)),
    }
