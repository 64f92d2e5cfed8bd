"""Parallel split learning (Jeon & Kim 2020; Joshi et al. 2021): client parts are never averaged.

Every client keeps its own client part (and its optimizer) for the whole run; there is no sync
server. The training server pairs each sampled client with a copy of the server part, and at the
end of the round averages the copies with weights |D_k| (inside the server: no communication).
Clients are independent within a round, so they are processed one after another into a running
average. With one client this is SFL-V1 with one client (tested).

`PersonalClients` is the part shared with SGLR and the cycle versions of both: client parts made
from the initial weights the first time a client is sampled (so memory grows with the clients
that have trained, not with K), checkpointed by client id, and used for that client's evaluation.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from splitlab.algorithms.base import Algorithm, Context
from splitlab.roles import Client, ModelAverage, Part


class PersonalClients(Algorithm):
    """Base for algorithms whose clients keep their own client part and optimizer across rounds."""

    personal_models = True

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._initial_client, server_model = ctx.new_split()
        self.server_model = server_model
        self.client_parts: dict[int, Part] = {}

    def client_part(self, client_id: int) -> Part:
        """Client `client_id`'s own part; starts from the initial weights the first time."""
        if client_id not in self.client_parts:
            model = copy.deepcopy(self._initial_client)
            self.client_parts[client_id] = self.ctx.part(model)
        return self.client_parts[client_id]

    def client_model(self, client_id: int) -> nn.Module:
        part = self.client_parts.get(client_id)
        return self._initial_client if part is None else part.model

    def predict_for_client(self, client_id: int, x: torch.Tensor) -> torch.Tensor:
        return self.server_model(self.client_model(client_id)(x))

    # --- checkpointing: the dict of parts is keyed by client id --------------------------
    def modules(self) -> list[nn.Module]:
        return super().modules() + [part.model for part in self.client_parts.values()]

    def state_dict(self) -> dict[str, object]:
        state = super().state_dict()
        for k, part in self.client_parts.items():
            state[f"client_parts.{k}.model"] = part.model.state_dict()
            state[f"client_parts.{k}.optimizer"] = part.optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, object]) -> None:
        state = dict(state)
        ids = sorted({int(name.split(".")[1]) for name in state if name.startswith("client_parts.")})
        for k in ids:
            part = self.client_part(k)
            part.model.load_state_dict(state.pop(f"client_parts.{k}.model"))
            part.optimizer.load_state_dict(state.pop(f"client_parts.{k}.optimizer"))
        super().load_state_dict(state)


class PSL(PersonalClients):
    name = "psl"

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._server_copy = self.working_copy(self.server_model)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        average = ModelAverage()
        for client, alpha in zip(clients, self.ctx.weights(clients)):
            self._server_copy.load_state_dict(self.server_model.state_dict())
            server = self.ctx.part(self._server_copy)
            part = self.client_part(client.id)
            for x, y in self.ctx.batches(client, rnd):
                self.split_step(part, server, x, y)
            average.add(self._server_copy.state_dict(), alpha)
        self.average_into(self.server_model, average)
