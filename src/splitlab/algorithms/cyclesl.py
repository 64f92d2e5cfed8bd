"""CycleSL (Wang, Bozkir & Kasneci; seed `cyclesl.txt`, Algorithm 1) and its four base methods.

One round of Algorithm 1 for the sampled clients S_t:

    ClientFP      each client sends the features of ONE mini-batch (and its labels)
    server task   the server pools them into a feature dataset, resamples mini-batches of
                  `server_batch_size` and trains for `server_epochs`, each sample's loss weighted
                  by its client's |D_k| (the authors' code)
    ServerGrad    frozen, the *updated* server computes each client's cut gradient on the
                  client's original batch (mean loss over that batch)
    ClientBP      clients step

`cycle()` is that round for a group of clients; each variant says who holds the client parts and
how they are aggregated: cycle_psl (personal parts), cycle_sglr (personal parts, cut gradients
averaged over a subset as in SGLR), cycle_sfl (FedAvg of per-round copies, as SFL) and cycle_ssl
(one part relayed from client to client, each client a cycle of its own, as the authors' CycleSSL).
The server part is one model with one optimizer for the whole run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from splitlab.algorithms.base import STREAM_SERVER_BATCHES, Algorithm, Context
from splitlab.algorithms.psl import PersonalClients
from splitlab.algorithms.sglr import SGLRParams, averaged_clients, client_step, send_cut_grads
from splitlab.algorithms.sl import Relay
from splitlab.roles import Client, CopyPool, ModelAverage, Part


class CycleParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_epochs: int = Field(1, ge=1, description="passes of the server over the round's pooled features")
    server_batch_size: int | None = Field(None, ge=1, description="server mini-batch size (default: batch_size)")
    server_lr: float | None = Field(None, gt=0, description="server-side learning rate (default: lr)")


class CycleSGLRParams(CycleParams, SGLRParams):
    pass


class CycleSL(Algorithm):
    """Algorithm 1. Subclasses set `server_model`, call `init_server` and implement `train_round`."""

    def init_server(self) -> None:
        self.server_optimizer = self.ctx.optimizer(self.server_model, lr=self.params.server_lr)

    def cycle(self, rnd: int, clients: list[Client], parts: list[Part]) -> None:
        smashed, features, labels = [], [], []
        for client, part in zip(clients, parts):                              # ClientFP
            x, y = next(iter(self.ctx.batches(client, rnd)))
            with self.timed("client"):
                smashed.append(part.model(x))
            features.append(self.channel.send("smashed", smashed[-1]))
            labels.append(self.channel.send("labels", y))
        self.train_server(rnd, clients, features, labels)                     # ServerGrad(pool, false)
        with self.timed("server"):
            grads = [self.frozen_cut_grad(z, y) for z, y in zip(features, labels)]  # ServerGrad(B_i, true)
        for part, z, grad in zip(parts, smashed, self.send_cut_grads(rnd, clients, grads)):  # ClientBP
            with self.timed("client"):
                client_step(part, z, grad)

    def train_server(self, rnd: int, clients: list[Client], features: list[torch.Tensor],
                     labels: list[torch.Tensor]) -> None:
        """The higher-level task: resampled mini-batches of the pooled features, loss weighted by |D_k|."""
        x, y = torch.cat(features), torch.cat(labels)
        weight = torch.cat([torch.full((len(f),), float(c.num_samples), device=x.device)
                            for f, c in zip(features, clients)])
        batch_size = self.params.server_batch_size or self.ctx.config.batch_size
        with self.timed("server"):
            for epoch in range(self.params.server_epochs):
                order = self.ctx.rng(rnd, STREAM_SERVER_BATCHES, clients[0].id, epoch).permutation(len(y))
                order = torch.as_tensor(order, device=x.device)
                for start in range(0, len(y), batch_size):
                    idx = order[start:start + batch_size]
                    per_sample = F.cross_entropy(self.server_model(x[idx]), y[idx], reduction="none")
                    loss = (per_sample * weight[idx]).sum() / weight[idx].sum()
                    self.server_optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    self.server_optimizer.step()
                    self.track(loss)

    def frozen_cut_grad(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """d loss / d features through the server, computing no gradient for its weights."""
        features = features.detach().requires_grad_()
        return torch.autograd.grad(self.loss(self.server_model(features), labels), features)[0]

    def send_cut_grads(self, rnd: int, clients: list[Client], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return [self.channel.send("cut_grad", grad) for grad in grads]


class CyclePSL(CycleSL, PersonalClients):
    name = "cycle_psl"
    Params = CycleParams

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.init_server()

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        self.cycle(rnd, clients, [self.client_part(client.id) for client in clients])


class CycleSGLR(CyclePSL):
    name = "cycle_sglr"
    Params = CycleSGLRParams

    def send_cut_grads(self, rnd: int, clients: list[Client], grads: list[torch.Tensor]) -> list[torch.Tensor]:
        averaged = averaged_clients(self.ctx, rnd, len(clients), self.params.average_fraction)
        return send_cut_grads(self.channel, grads, [c.num_samples for c in clients], averaged)


class CycleSFL(CycleSL):
    name = "cycle_sfl"
    Params = CycleParams

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.client_model, self.server_model = ctx.new_split()
        self.init_server()
        self._copies = CopyPool(self.client_model)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        copies = self._copies.take(len(clients))  # one live copy per sampled client (graphs kept)
        for copy in copies:
            self.download("client_model_down", self.client_model, copy)
        self.cycle(rnd, clients, [self.ctx.part(copy) for copy in copies])
        average = ModelAverage()
        for copy, alpha in zip(copies, self.ctx.weights(clients)):
            average.add(self.channel.send("client_model_up", copy.state_dict()), alpha)
        self.average_into(self.client_model, average)

    def global_parts(self):
        return [self.client_model, self.server_model]


class CycleSSL(CycleSL, Relay):
    """Sequential SL with the cycle update: clients in id order, each one cycle on its own batch."""

    name = "cycle_ssl"
    Params = CycleParams

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.client_model, self.server_model = ctx.new_split()
        self.init_server()

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        for client in clients:
            self.hand_to(client)
            self.cycle(rnd, [client], [self.ctx.part(self.client_model)])

    def global_parts(self):
        return [self.client_model, self.server_model]
