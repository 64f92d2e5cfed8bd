"""CSE-FSL (Mu & Shen 2023, as summarised in the FSL-SAGE paper): clients learn from a local loss.

Each client trains its client part together with an auxiliary head (models/aux.py) on the local
loss CE(aux(client(x)), y), so no gradient ever comes back from the server. At every q-th local
step (steps 0, q, 2q, ... of the round, as in the authors' code) the client also sends that
batch's smashed data and labels; the single server part takes one step on them. After the round
the sync server averages the client parts and the auxiliary heads (weights |D_k|); both travel
down and up every round.

`AuxiliaryFSL` is what CSE-FSL and FSL-SAGE share. Clients take their local steps interleaved
as in SplitFed-v2's default schedule: at each local step the clients with batches left go in a
fresh random order, which is the server's first-come-first-served order of the FSL-SAGE paper's
Algorithm 3 (with q = 1 the server sees exactly SFL-V2's sequence of batches). Nothing the
server does reaches a client within a round, so the order only matters to the server part.
"""

from __future__ import annotations


import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from splitlab.algorithms.base import Algorithm, Context
from splitlab.models.aux import AuxKind, build_aux
from splitlab.roles import Client, CopyPool, ModelAverage, Part


class CSEFSLParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_update_interval: int = Field(
        5, ge=1, description="q: a client sends smashed data + labels at every q-th local step (authors: 5)")
    aux: AuxKind = Field("stage", description="auxiliary model: linear | half | stage | full (FSL-SAGE App. D.4)")


class AuxiliaryFSL(Algorithm):
    """Federated split learning with auxiliary models: client parts averaged every round, one
    server part fed every q-th step. Subclasses say how a client steps and what ends a round."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.client_model, server_model = ctx.new_split()
        self.server = ctx.part(server_model)
        self._client_copies = CopyPool(self.client_model)

    def new_aux(self) -> nn.Module:
        """The initial auxiliary model for this run's model, cut and seed."""
        cfg, data = self.ctx.config, self.ctx.data
        return build_aux(self.params.aux, self.ctx.new_model().cpu(), cfg.cut, data.input_shape,
                         seed=cfg.seed, dtype=data.train_x.dtype).to(self.ctx.device)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        locals_ = [self.start_client(slot, client) for slot, client in enumerate(clients)]
        for k, step, (x, y) in self.ctx.interleaved(rnd, clients):
            smashed = self.client_step(*locals_[k], x, y)
            if step % self.params.server_update_interval == 0:
                self.server_step(clients[k], smashed, y)
        self.finish_round(rnd, clients, locals_)

    def server_step(self, client: Client, smashed: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Smashed data and labels up, one server step; nothing goes back. Returns what arrived."""
        received, labels = self.channel.send("smashed", smashed), self.channel.send("labels", y)
        with self.timed("server"):
            loss = self.loss(self.server.model(received), labels)
            self.server.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.server.optimizer.step()
        self.track(loss)
        return received, labels

    def client_copy(self, slot: int) -> Part:
        """The slot-th client's working copy of the global client part, downloaded, with a fresh optimizer."""
        copy = self._client_copies.take(slot + 1)[slot]
        self.download("client_model_down", self.client_model, copy)
        return self.ctx.part(copy)

    def average_client_parts(self, clients: list[Client], parts: list[Part]) -> None:
        average = ModelAverage()
        for part, alpha in zip(parts, self.ctx.weights(clients)):
            average.add(self.channel.send("client_model_up", part.model.state_dict()), alpha)
        self.average_into(self.client_model, average)

    def start_client(self, slot: int, client: Client) -> tuple:
        raise NotImplementedError

    def client_step(self, client: Part, aux, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def finish_round(self, rnd: int, clients: list[Client], locals_: list[tuple]) -> None:
        raise NotImplementedError

    def global_parts(self):
        return [self.client_model, self.server.model]


class CSEFSL(AuxiliaryFSL):
    name = "cse_fsl"
    Params = CSEFSLParams

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.aux_model = self.new_aux()
        self._aux_copies = CopyPool(self.aux_model)

    def start_client(self, slot: int, client: Client) -> tuple[Part, Part]:
        aux = self._aux_copies.take(slot + 1)[slot]
        self.download("aux_model_down", self.aux_model, aux)
        return self.client_copy(slot), self.ctx.part(aux)

    def client_step(self, client: Part, aux: Part, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One step of client part and auxiliary head on the local loss; returns the smashed data."""
        with self.timed("client"):
            smashed = client.model(x)
            loss = self.loss(aux.model(smashed), y)
            client.optimizer.zero_grad(set_to_none=True)
            aux.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            client.optimizer.step()
            aux.optimizer.step()
        return smashed.detach()

    def finish_round(self, rnd: int, clients: list[Client], locals_: list[tuple[Part, Part]]) -> None:
        self.average_client_parts(clients, [client for client, _ in locals_])
        average = ModelAverage()
        for (_, aux), alpha in zip(locals_, self.ctx.weights(clients)):
            average.add(self.channel.send("aux_model_up", aux.model.state_dict()), alpha)
        self.average_into(self.aux_model, average)
