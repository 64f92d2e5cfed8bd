"""Centralized training on the union of all clients' data: the reference every method is held to."""

from __future__ import annotations

import torch

from splitlab.algorithms.base import Algorithm, Context
from splitlab.roles import Client


class Centralized(Algorithm):
    """One model, one optimizer, all training samples as a single data owner (id 0). No channel."""

    name = "centralized"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.model = ctx.part(ctx.new_model())
        self._everyone = Client(0, torch.cat([c.indices for c in ctx.clients]).sort().values)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        for x, y in self.ctx.batches(self._everyone, rnd):
            self.local_step(self.model, x, y)

    def global_parts(self):
        return [self.model.model]
