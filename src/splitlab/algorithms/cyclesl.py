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
The server part is one model with one optimizer for the whole run; the server task and ServerGrad
run in the training server (`CycleServer.cycle`), the rest is the orchestration below.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from pydantic import BaseModel, ConfigDict, Field

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.algorithms.psl import PersonalClients
from splitlab.algorithms.sglr import ServerWithOwnLR, SGLRParams, average_cut_grads, averaged_clients
from splitlab.algorithms.sl import Relay
from splitlab.privacy.defenses import decode
from splitlab.roles import State
from splitlab.streams import register_stream
from splitlab.transport import verb

STREAM_SERVER_BATCHES = register_stream("cyclesl.server_batches", 4)


class CycleParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_epochs: int = Field(1, ge=1, le=100_000, description="passes of the server over the round's pooled features")
    server_batch_size: int | None = Field(
        None, ge=1, le=1_000_000, description="server mini-batch size (default: batch_size)"
    )
    server_lr: float | None = Field(None, gt=0, le=1e6, description="server-side learning rate (default: lr)")


class CycleSGLRParams(CycleParams, SGLRParams):
    pass


class CycleServer(ServerWithOwnLR[CycleParams]):
    @verb()
    def cycle(
        self,
        rnd: int,
        features: list[torch.Tensor],
        labels: list[torch.Tensor],
        sizes: list[int],
        first_client: int,
        averaged: list[int],
    ) -> State:
        """The server task on the pooled features, then each client's cut gradient from the frozen,
        updated server (averaged over the clients in `averaged`, as SGLR)."""
        features = [decode(z) for z in features]
        losses = self.train_pooled(rnd, features, labels, sizes, first_client)
        with self.blueprint.timed("server"):
            grads = [self.frozen_cut_grad(z, y) for z, y in zip(features, labels)]
        cut_grads = average_cut_grads(grads, sizes, set(averaged))
        return {"cut_grads": [self.send_gradient(g) for g in cut_grads], "losses": losses}

    def train_pooled(
        self, rnd: int, features: list[torch.Tensor], labels: list[torch.Tensor], sizes: list[int], first_client: int
    ) -> list[torch.Tensor]:
        """The higher-level task: resampled mini-batches of the pooled features, loss weighted by |D_k|."""
        x, y = torch.cat(features), torch.cat(labels)
        weight = torch.cat([torch.full((len(f),), float(n), device=x.device) for f, n in zip(features, sizes)])
        params = self.params
        batch_size = params.server_batch_size or self.blueprint.config.batch_size
        model, losses = self.model("server_model"), []
        with self.blueprint.timed("server"):
            for epoch in range(params.server_epochs):
                order = self.blueprint.rng(rnd, STREAM_SERVER_BATCHES, first_client, epoch).permutation(len(y))
                for idx in torch.as_tensor(order, device=x.device).split(batch_size):
                    value = self.blueprint.loss.weighted(model(x[idx]), y[idx], weight[idx])
                    self.step("server_model", value.backward)
                    losses.append(value.detach())
        return losses

    def frozen_cut_grad(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """d loss / d features through the server, computing no gradient for its weights."""
        features = features.detach().requires_grad_()
        return torch.autograd.grad(self.blueprint.loss(self.model("server_model")(features), labels), features)[0]


class CycleSL(Algorithm):
    """Algorithm 1, for whatever holds the round's client parts."""

    Server = CycleServer
    not_u_shaped = "its server trains on the round's pooled features for server_epochs, which needs their labels"

    def cycle(self, rnd: int, clients: list[ClientInfo], averaged: Collection[int] = ()) -> None:
        """`averaged`: ids of the clients whose cut gradients are averaged. A client that drops
        out is left out of the pooled features (and of what follows)."""
        clients, sent = self.forwards(clients, 0)  # ClientFP
        if not clients:
            return
        reply = self.server.cycle(
            rnd,
            [s["smashed"] for s in sent],
            [s["labels"] for s in sent],
            [c.num_samples for c in clients],
            clients[0].id,  # server task,
            [i for i, c in enumerate(clients) if c.id in averaged],
        )  # ServerGrad
        for value in reply["losses"]:
            self.track(value)
        for client, grad in zip(clients, reply["cut_grads"]):  # ClientBP
            self.unless_dropped(client.id, "backward", 0, grad)


class CyclePSL(CycleSL, PersonalClients, Algorithm[CycleParams]):
    name = "cycle_psl"

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        self.cycle(rnd, clients)


class CycleSGLR(CycleSL, PersonalClients, Algorithm[CycleSGLRParams]):
    name = "cycle_sglr"

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        self.cycle(rnd, clients, averaged_clients(self.ctx, rnd, clients, self.params.average_fraction))


class CycleSFL(CycleSL, Algorithm[CycleParams]):
    name = "cycle_sfl"

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client in clients:  # one live copy per sampled client (graphs kept)
            self.download(client.id)
        self.cycle(rnd, clients)
        self.federated_average(clients)


class CycleSSL(CycleSL, Relay, Algorithm[CycleParams]):
    """Sequential SL with the cycle update: clients in id order, each one cycle on its own batch."""

    name = "cycle_ssl"

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client in clients:
            self.hand_to(client.id)
            self.cycle(rnd, [client])
