"""SplitFed v2 (Thapa et al. 2022; cut-layer paper, Algorithm 2): one shared server model.

Client parts are per-client copies averaged by the sync server after each round (weights |D_k|);
the single server part is trained on every client's smashed data in turn and keeps its optimizer
for the whole run. Two server schedules:

- `interleaved` (default; the cut-layer paper's Algorithm 2): at every local step each client
  with batches left sends one batch, and the server takes them in a fresh random order.
- `sequential` (the original SplitFed code): clients in a random order, each running all its
  local epochs with the server before the next starts. Needs one client copy at a time.

With one client both are centralized training at any cut (tested).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from splitlab.algorithms.base import STREAM_ORDER, Algorithm, Context
from splitlab.roles import Client, CopyPool, ModelAverage


class SFLV2Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_schedule: Literal["interleaved", "sequential"] = "interleaved"


class SFLV2(Algorithm):
    name = "sfl_v2"
    Params = SFLV2Params

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.client_model, server_model = ctx.new_split()
        self.server = ctx.part(server_model)
        self._client_copies = CopyPool(self.client_model)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        if self.params.server_schedule == "interleaved":
            self._interleaved_round(rnd, clients)
        else:
            self._sequential_round(rnd, clients)

    def _interleaved_round(self, rnd: int, clients: list[Client]) -> None:
        copies = self._client_copies.take(len(clients))
        parts = []
        for copy in copies:
            self.download("client_model_down", self.client_model, copy)
            parts.append(self.ctx.part(copy))
        for k, _, (x, y) in self.ctx.interleaved(rnd, clients):
            self.split_step(parts[k], self.server, x, y)
        average = ModelAverage()
        for copy, alpha in zip(copies, self.ctx.weights(clients)):
            average.add(self.channel.send("client_model_up", copy.state_dict()), alpha)
        self.average_into(self.client_model, average)

    def _sequential_round(self, rnd: int, clients: list[Client]) -> None:
        (copy,) = self._client_copies.take(1)
        average = ModelAverage()
        alphas = self.ctx.weights(clients)
        for k in self.ctx.rng(rnd, STREAM_ORDER).permutation(len(clients)):
            self.download("client_model_down", self.client_model, copy)
            part = self.ctx.part(copy)
            for x, y in self.ctx.batches(clients[k], rnd):
                self.split_step(part, self.server, x, y)
            average.add(self.channel.send("client_model_up", copy.state_dict()), alphas[k])
        self.average_into(self.client_model, average)

    def global_parts(self):
        return [self.client_model, self.server.model]
