"""SGLR (Pal et al. 2021, arXiv 2112.05929): server-side local gradient averaging and separate
server/client learning rates on top of parallel split learning.

Client parts are personal, as in PSL (never averaged). The round's clients run in lockstep: at
every local step each client with batches left sends one batch; the one server part takes one
step on the |D_k|-weighted mean of the clients' losses (learning rate `server_lr`), and returns
each client the gradient of its own loss at the cut. Before they go back, the cut gradients of
a seeded subset of the round's clients (int(average_fraction * n) of them) are replaced by their
common mean over every sample of the subset (sample weights |D_k|): one vector, sent once to each
client of the subset and broadcast over its batch. The others get their own gradient. Clients
step with `lr`. What the paper does and does not pin down, and where this reading follows the
CycleSL authors' SGLR code, is in docs/cyclesl.md.
"""

from __future__ import annotations

import itertools

import torch
from pydantic import BaseModel, ConfigDict, Field

from splitlab.algorithms.base import STREAM_SUBSET, Context
from splitlab.algorithms.psl import PersonalClients
from splitlab.channel import Channel
from splitlab.roles import Client, Part


class SGLRParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_lr: float | None = Field(None, gt=0, description="server-side learning rate (default: lr, the "
                                                            "client-side one); SGLR's acceleration is a larger value")
    average_fraction: float = Field(0.5, gt=0, le=1, description="fraction of the round's clients whose cut "
                                                                 "gradients are averaged (0.5 in the CycleSL code)")


def averaged_clients(ctx: Context, rnd: int, count: int, fraction: float) -> set[int]:
    """Positions (in the round's client list) of the int(fraction * count) clients whose cut
    gradients are averaged this round; a seeded choice."""
    chosen = ctx.rng(rnd, STREAM_SUBSET).choice(count, int(fraction * count), replace=False)
    return {int(k) for k in chosen}


def send_cut_grads(channel: Channel, grads: list[torch.Tensor], sizes: list[int],
                   averaged: set[int]) -> list[torch.Tensor]:
    """The cut gradients as the clients receive them: clients in `averaged` get one vector (shape
    (1, ...)), the mean over all samples of those clients with sample weights |D_k|."""
    if averaged:
        total = sum(sizes[k] * grads[k].sum(0, keepdim=True) for k in averaged)
        mean = total / sum(sizes[k] * len(grads[k]) for k in averaged)
    return [channel.send("cut_grad", mean if k in averaged else g) for k, g in enumerate(grads)]


def client_step(part: Part, smashed: torch.Tensor, grad: torch.Tensor) -> None:
    """Back-propagate a received cut gradient (broadcast over the batch if it is one vector)."""
    part.optimizer.zero_grad(set_to_none=True)
    smashed.backward(grad.expand_as(smashed))
    part.optimizer.step()


class SGLR(PersonalClients):
    name = "sglr"
    Params = SGLRParams

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.server_optimizer = ctx.optimizer(self.server_model, lr=self.params.server_lr)

    def train_round(self, rnd: int, clients: list[Client]) -> None:
        averaged = averaged_clients(self.ctx, rnd, len(clients), self.params.average_fraction)
        steps = itertools.zip_longest(*[self.ctx.batches(client, rnd) for client in clients])
        for batches in steps:
            active = [k for k, batch in enumerate(batches) if batch is not None]
            self._parallel_step([clients[k] for k in active], [batches[k] for k in active],
                                {i for i, k in enumerate(active) if k in averaged})

    def _parallel_step(self, clients: list[Client], batches: list, averaged: set[int]) -> None:
        parts = [self.client_part(client.id) for client in clients]
        with self.timed("client"):
            smashed = [part.model(x) for part, (x, _) in zip(parts, batches)]
        received = [self.channel.send("smashed", z).requires_grad_() for z in smashed]
        labels = [self.channel.send("labels", y) for _, y in batches]
        alphas = self.ctx.weights(clients)
        with self.timed("server"):
            losses = [self.loss(self.server_model(z), y) for z, y in zip(received, labels)]
            loss = sum(alpha * l for alpha, l in zip(alphas, losses))
            self.server_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.server_optimizer.step()
            grads = [z.grad / alpha for z, alpha in zip(received, alphas)]  # d(own loss)/d(smashed)
        sizes = [client.num_samples for client in clients]
        for part, z, grad in zip(parts, smashed, send_cut_grads(self.channel, grads, sizes, averaged)):
            with self.timed("client"):
                client_step(part, z, grad)
        self.track(loss)
