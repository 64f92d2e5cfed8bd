"""Defense-aware label attacks on the cut gradients of a binary task, scored per batch (`label_leak`
reports them beside Li et al.'s norm and direction attacks). They need no sample of known label:
each batch's gradients are split into two clusters and the larger one is called the class that
is the more frequent in the attacker's auxiliary data (`majority`).

- **cluster**: the clustering attack of Liu, Lyu, Cui & Tao ("Similarity-based Label Inference
  Attack against Training and Inference of Split Learning", IEEE TIFS 2024, arXiv 2203.05222),
  which clusters the cut gradients by cosine similarity; here in one dimension: each gradient's
  unit vector projected on the batch's top principal direction, split by 2-means. It reads the
  labels the loss was computed with, which is what randomised response (`label_dp`) flips.
- **residual**: against Marvell. Marvell's optimum (Li et al. 2022, Theorem 2) equalises the two
  classes' variances across the class-difference direction by noising only the class of the
  smaller variance, and puts most of its power along that direction. Its model gives each class
  one variance, but a trained model's per-sample gradients are mostly tiny with a few large: the
  noised class then has large gradient norms across the top direction, all alike, the other
  class the small ones of its own. So: remove each gradient's component along the batch's top
  principal direction, take the log of the norm of the rest, split by 2-means. (The attack of the
  independent audit behind issue 42; no published form of it was found.)
- **linked**: against randomised response, which flips each release of a label afresh: a sample's
  cluster scores averaged over its releases in every recorded round. The server knows the run's
  seed, hence each client's batch order (`Context.rng`), hence which release is which sample;
  the experimenter's record links them by their recorded inputs (identical inputs: one sample).

Each sample's score is its value's signed distance from the 2-means threshold over the distance
between the two cluster means, positive on the side called positive, so scores of different
batches are on one scale (pooled AUCs, and `linked`'s means).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splitlab.audit.records import sample_keys

#: the attacks of this module, in the order reported
ATTACKS = ("cluster", "residual")


def two_means(values: np.ndarray) -> tuple[float, np.ndarray]:
    """The exact 2-means split of 1-D `values` (the cut between sorted neighbours with the least
    within-cluster sum of squares): (the threshold, midway between the two clusters' nearest
    members, and whether each value lies above it). One distinct value: all below."""
    ordered = np.sort(values.astype(np.float64))
    n = len(ordered)
    if n < 2 or ordered[0] == ordered[-1]:
        return float(ordered[-1]), np.zeros(n, dtype=bool)
    prefix, prefix2 = np.cumsum(ordered), np.cumsum(ordered**2)
    k = np.arange(1, n)  # the first k values form the lower cluster
    low = prefix2[:-1] - prefix[:-1] ** 2 / k
    high = (prefix2[-1] - prefix2[:-1]) - (prefix[-1] - prefix[:-1]) ** 2 / (n - k)
    cost = np.where(ordered[1:] > ordered[:-1], low + high, np.inf)  # never cut between equal values
    best = int(np.argmin(cost)) + 1
    threshold = (ordered[best - 1] + ordered[best]) / 2
    return float(threshold), values > threshold


def cluster_scores(values: np.ndarray, majority: bool) -> np.ndarray:
    """Scores for the positive class from one batch's 1-D values: 2-means, the larger cluster is
    the `majority` class (True: the positives), a tie goes to the upper cluster; each score is the
    value's distance from the threshold over the distance between the cluster means, signed."""
    threshold, upper = two_means(values)
    if upper.all() or not upper.any():
        return np.zeros(len(values))
    gap = values[upper].mean() - values[~upper].mean()
    upper_is_majority = upper.sum() >= (~upper).sum()
    sign = 1.0 if upper_is_majority == majority else -1.0
    return sign * (values - threshold) / gap


def top_direction(rows: torch.Tensor) -> torch.Tensor:
    """The unit top principal direction of a batch's rows (about their mean)."""
    centred = rows - rows.mean(0, keepdim=True)
    return torch.linalg.svd(centred, full_matrices=False).Vh[0]


def batch_values(grads: torch.Tensor) -> dict[str, np.ndarray]:
    """Each attack's 1-D value per gradient of one batch (`ATTACKS`)."""
    flat = grads.detach().flatten(1).double().cpu()
    unit = torch.nn.functional.normalize(flat, dim=1)
    along = top_direction(flat)
    residual = flat - (flat @ along)[:, None] * along
    tiny = torch.finfo(torch.float64).tiny
    return {
        "cluster": (unit @ top_direction(unit)).numpy(),
        "residual": residual.norm(dim=1).clamp_min(tiny).log().numpy(),
    }


def scores(grads: torch.Tensor, batches: torch.Tensor, majority: bool) -> dict[str, np.ndarray]:
    """Each attack's score per sample, computed within each batch (a sample of a batch cut short,
    -1, or of a batch of one sample scores 0: no batch to cluster)."""
    found = {name: np.zeros(len(grads)) for name in ATTACKS}
    numbers = batches.cpu().numpy()
    for number in np.unique(numbers):
        members = np.flatnonzero(numbers == number)
        if number < 0 or len(members) < 2:
            continue
        for name, values in batch_values(grads[members]).items():
            found[name][members] = cluster_scores(values, majority)
    return found


def auc(positive: np.ndarray, score: np.ndarray) -> float | None:
    """ROC AUC of `score` for the positives, ties counting half (the Mann-Whitney U over n1 n0, from
    average ranks); None where one class is missing."""
    positive = np.asarray(positive, dtype=bool)
    n1 = int(positive.sum())
    n0 = len(positive) - n1
    if n1 == 0 or n0 == 0:
        return None
    _, inverse, counts = np.unique(score, return_inverse=True, return_counts=True)
    ranks = (np.cumsum(counts) - (counts - 1) / 2)[inverse]  # 1-based, tied values share their mean rank
    return float((ranks[positive].sum() - n1 * (n1 + 1) / 2) / (n1 * n0))


def pooled(grads: torch.Tensor, labels: torch.Tensor, batches: torch.Tensor, majority: bool) -> dict[str, Any]:
    """`<attack>_auc`: each attack's AUC over the samples of whole batches, scored within their batch."""
    whole = (batches >= 0).cpu().numpy()
    positive = (labels == 1).cpu().numpy()[whole]
    found = scores(grads, batches, majority)
    return {f"{name}_auc": auc(positive, found[name][whole]) for name in ATTACKS}


def linked(rounds: list[dict[str, torch.Tensor]], gradient: str, majority: bool) -> dict[str, Any]:
    """The cluster attack's scores averaged over each sample's releases in every recorded round
    (releases linked by identical recorded inputs), scored on every sample recorded in a whole
    batch: its AUC, the samples, and their mean number of releases."""
    sums: dict[bytes, float] = {}
    counts: dict[bytes, int] = {}
    truth: dict[bytes, bool] = {}
    for tensors in rounds:
        batches = tensors["batches"]
        found = scores(tensors[gradient], batches, majority)["cluster"]
        for key, label, number, score in zip(sample_keys(tensors["inputs"]), tensors["labels"], batches, found):
            if int(number) < 0:
                continue
            sums[key], counts[key] = sums.get(key, 0.0) + float(score), counts.get(key, 0) + 1
            truth[key] = int(label) == 1
    if not sums:
        return {}
    keys = list(sums)
    value = auc(np.array([truth[k] for k in keys]), np.array([sums[k] / counts[k] for k in keys]))
    return {"auc": value, "samples": len(keys), "releases_mean": float(np.mean([counts[k] for k in keys]))}
