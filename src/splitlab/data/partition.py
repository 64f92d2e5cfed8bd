"""Split a training set's indices among clients: IID, Dirichlet label skew, or label shards.

Every partitioner returns one sorted int64 index array per client, so that a 1-client
partition is exactly `arange(N)` and results do not depend on the order of drawing.
"""

from __future__ import annotations

import math

import numpy as np

from splitlab.errors import UserError

_ALLOWED = "iid, dirichlet:<alpha> (a number > 0), shards:<shards_per_client> (an integer >= 1)"
_DIRICHLET_TRIES = 100


def parse_partition_scheme(scheme: str) -> tuple[str, float | int | None]:
    """`'iid'` -> ('iid', None), `'dirichlet:0.5'` -> ('dirichlet', 0.5), `'shards:2'` -> ('shards', 2)."""
    bad = UserError(f"bad partition scheme {scheme!r}; allowed: {_ALLOWED}")
    if not isinstance(scheme, str):
        raise bad
    kind, _, arg = scheme.partition(":")
    if scheme == "iid":
        return "iid", None
    if kind == "dirichlet":
        try:
            alpha = float(arg)
        except ValueError:
            raise bad from None
        if not (math.isfinite(alpha) and alpha > 0):
            raise bad
        return "dirichlet", alpha
    if kind == "shards" and arg.isdecimal() and int(arg) >= 1:
        return "shards", int(arg)
    raise bad


def partition(labels: np.ndarray, num_clients: int, scheme: str, seed: int) -> list[np.ndarray]:
    """Disjoint, sorted int64 index arrays, one per client; deterministic given `seed`.

    - `iid`: a random permutation cut into `num_clients` near-equal parts.
    - `dirichlet:<alpha>`: per class, proportions ~ Dir(alpha * 1_K) split that class among the
      clients (smaller alpha = more label skew); redrawn until every client has a sample.
    - `shards:<s>` (McMahan et al. 2017, SplitGP): sort by label, cut into `num_clients * s`
      equal shards and give each client `s` random shards. If N is not divisible by the number
      of shards, the remainder (a random `N mod (num_clients * s)` samples) is dropped; iid and
      dirichlet always cover every index.
    """
    kind, arg = parse_partition_scheme(scheme)
    labels = np.asarray(labels)
    n = len(labels)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise UserError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    if num_clients > n:
        raise UserError(f"{num_clients} clients but only {n} samples; use at most {n} clients")
    rng = np.random.default_rng(seed)
    if arg is None:  # iid, the one scheme without an argument
        parts = np.array_split(rng.permutation(n), num_clients)
    elif kind == "dirichlet":
        parts = _dirichlet(labels, num_clients, float(arg), rng)
    else:
        parts = _shards(labels, num_clients, int(arg), rng)
    return [np.sort(p).astype(np.int64) for p in parts]


def _dirichlet(labels: np.ndarray, k: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    by_class = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(k)]
        for idx in by_class:
            idx = rng.permutation(idx)
            cuts = (np.cumsum(rng.dirichlet(np.full(k, alpha)))[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                parts[client].append(chunk)
        merged = [np.concatenate(p) for p in parts]
        if min(len(p) for p in merged) >= 1:
            return merged
    raise UserError(
        f"dirichlet:{alpha} left a client with no samples in {_DIRICHLET_TRIES} draws for "
        f"{k} clients and {len(labels)} samples; use fewer clients or a larger alpha"
    )


def _shards(labels: np.ndarray, k: int, s: int, rng: np.random.Generator) -> list[np.ndarray]:
    num_shards = k * s
    size = len(labels) // num_shards
    if size == 0:
        raise UserError(
            f"shards:{s} with {k} clients needs at least {num_shards} samples, got {len(labels)}; "
            f"use fewer clients or fewer shards per client"
        )
    # a random subset of the right size, then sorted by label (stable, so random within a class)
    kept = rng.permutation(len(labels))[: num_shards * size]
    order = kept[np.argsort(labels[kept], kind="stable")]
    shards = order.reshape(num_shards, size)
    owner = rng.permutation(num_shards).reshape(k, s)
    return [shards[row].ravel() for row in owner]


def partition_report(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> dict:
    """Per-client class counts and sizes as plain ints (JSON-serializable)."""
    labels = np.asarray(labels)
    counts = []
    for p in parts:
        c = np.bincount(labels[p], minlength=num_classes)
        if len(c) > num_classes:
            raise ValueError(f"label {len(c) - 1} is outside 0..{num_classes - 1}")
        counts.append([int(v) for v in c])
    return counts_report(counts, num_classes)


def counts_report(counts: list[list[int]], num_classes: int) -> dict:
    """The report of clients holding `counts[k][c]` samples of class c (as the clients of data=own say)."""
    return {
        "num_clients": len(counts),
        "num_classes": num_classes,
        "counts": counts,
        "sizes": [sum(c) for c in counts],
    }
