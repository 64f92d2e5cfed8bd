"""Who holds what: clients own data, parts pair a model with its optimizer, the sync server averages.

Roles never hand each other tensors directly; that goes through `splitlab.channel.Channel`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass
class Client:
    """A client: an id and the indices of its private training samples (sorted, on the device)."""

    id: int
    indices: torch.Tensor

    @property
    def num_samples(self) -> int:
        return int(self.indices.numel())

    def batches(self, x: torch.Tensor, y: torch.Tensor, batch_size: int,
                orders: list[np.ndarray]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Mini-batches over the local data, one pass per given permutation (one per epoch)."""
        for order in orders:
            shuffled = self.indices[torch.as_tensor(order, device=self.indices.device)]
            for start in range(0, len(shuffled), batch_size):
                idx = shuffled[start:start + batch_size]
                yield x[idx], y[idx]


@dataclass
class Part:
    """A model (or part of one) with the optimizer that updates it; they live and die together."""

    model: nn.Module
    optimizer: torch.optim.Optimizer


class CopyPool:
    """Scratch modules shaped like `source`, reused across rounds; grows to the most asked for.

    Algorithms that keep several client copies alive within a round take them from here
    instead of deep-copying every round; the caller loads weights into them before use.
    """

    def __init__(self, source: nn.Module) -> None:
        self.source = source
        self.copies: list[nn.Module] = []

    def take(self, count: int) -> list[nn.Module]:
        while len(self.copies) < count:
            self.copies.append(copy.deepcopy(self.source))
        return self.copies[:count]


class ModelAverage:
    """The sync server's FedAvg: sum_k alpha_k * w_k accumulated one model at a time.

    Keeping a running sum instead of K state dicts is what keeps memory flat in K. The caller
    passes normalised weights alpha_k (summing to 1), so one client with alpha = 1 is returned
    bit for bit. Integer buffers (BatchNorm's batch counters) are averaged and rounded.
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] | None = None

    def add(self, state: Mapping[str, torch.Tensor], alpha: float) -> None:
        if self._sum is None:
            self._sum = {k: _as_float(v) * alpha for k, v in state.items()}
        else:
            for k, v in state.items():
                self._sum[k].add_(_as_float(v), alpha=alpha)

    def result(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The average, cast back to the dtypes of `like` (usually the global model's state)."""
        if self._sum is None:
            raise RuntimeError("no model was added to the average")
        return {k: (self._sum[k].round() if not v.is_floating_point() else self._sum[k]).to(v.dtype)
                for k, v in like.items()}


def _as_float(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.is_floating_point() else t.detach().double()
