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

U-shaped (`cut=A,B`, docs/configurations.md), the lockstep has two halves around the clients'
tails: the server's outputs at the second cut go down, each client takes its own loss and sends
back its gradient there, and the server steps on sum_k alpha_k loss_k through those gradients.
"""

from __future__ import annotations

import functools
import typing
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from splitlab.algorithms.base import Algorithm, ClientInfo, Context
from splitlab.algorithms.psl import PersonalClients
from splitlab.privacy.defenses import decode
from splitlab.random_streams import register_stream
from splitlab.roles import ParamsT, State, TrainingServer
from splitlab.transport import verb

STREAM_SUBSET = register_stream("sglr.averaged_clients", 3)


class SGLRParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    server_lr: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="server-side learning rate (default: lr, the "
        "client-side one); SGLR's acceleration is a larger value",
    )
    average_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="fraction of the round's clients whose cut gradients are averaged (0.5 in the CycleSL code)",
    )


def averaged_clients(ctx: Context, rnd: int, clients: list[ClientInfo], fraction: float) -> set[int]:
    """Ids of the int(fraction * n) of the round's n clients whose cut gradients are averaged
    this round; a seeded choice."""
    chosen = ctx.rng(rnd, STREAM_SUBSET).choice(len(clients), int(fraction * len(clients)), replace=False)
    return {clients[k].id for k in chosen}


def average_cut_grads(grads: list[torch.Tensor], sizes: list[int], averaged: set[int]) -> list[torch.Tensor]:
    """The cut gradients as the clients receive them: clients in `averaged` get one vector (shape
    (1, ...)), the mean over all samples of those clients with sample weights |D_k|, in float32
    (a sum of half-precision, scaled gradients would overflow; `Role.crossing` casts back)."""
    if not averaged:
        return grads
    total = torch.stack([sizes[k] * grads[k].float().sum(0, keepdim=True) for k in sorted(averaged)]).sum(0)
    mean = total / sum(sizes[k] * len(grads[k]) for k in averaged)
    return [mean if k in averaged else g for k, g in enumerate(grads)]


class ServerWithOwnLR(TrainingServer[ParamsT]):
    """A training server whose optimizer uses `server_lr` (default: lr)."""

    def lr(self, slot: str) -> float | None:
        return getattr(self.params, "server_lr", None)


class SGLRServer(ServerWithOwnLR[SGLRParams]):
    #: U-shaped: the round's inputs and outputs awaiting the gradients at the second cut
    _lockstep: tuple[list[torch.Tensor], list[torch.Tensor]]

    @verb()
    def lockstep(
        self,
        smashed: list[torch.Tensor],
        labels: list[torch.Tensor],
        alphas: list[float],
        sizes: list[int],
        averaged: list[int],
    ) -> State:
        """One server step on sum_k alpha_k loss_k; each client's cut gradient (averaged over a subset)."""
        smashed = [decode(z).requires_grad_() for z in smashed]
        model = self.model("server_model")
        with self.blueprint.timed("server"):
            total = torch.stack(
                [alpha * self.blueprint.loss(model(z), y) for alpha, z, y in zip(alphas, smashed, labels)]
            ).sum()
            self.step("server_model", functools.partial(self.backward_pass, (total, None)))
            # d(own loss)/dz, in float32 (a half-precision scaled one over a small alpha may overflow)
            grads = [typing.cast(torch.Tensor, z.grad).float() / alpha for z, alpha in zip(smashed, alphas)]
        cut_grads = self.crossing(average_cut_grads(grads, sizes, set(averaged)))
        return {"cut_grads": [self.send_gradient(g, y) for g, y in zip(cut_grads, labels)], "loss": total.detach()}

    @verb()
    def lockstep_outputs(self, smashed: list[torch.Tensor]) -> list[torch.Tensor]:
        """U-shaped, the first half: the server's output at the second cut for each client's batch;
        the step waits for the gradients there (`lockstep_tails`)."""
        inputs = [decode(z).requires_grad_() for z in smashed]
        model = self.model("server_model")
        with self.blueprint.timed("server"):
            outputs = [model(z) for z in inputs]
        self._lockstep = inputs, outputs
        return [output.detach() for output in outputs]

    @verb()
    def lockstep_tails(
        self,
        replied: list[int],
        tail_grads: list[Any],
        alphas: list[float],
        sizes: list[int],
        averaged: list[int],
    ) -> State:
        """U-shaped, the second half: one server step on sum_k alpha_k loss_k over the clients that
        replied (positions `replied` in the first half), through their gradients at the second cut;
        each one's cut gradient (averaged over a subset), as `lockstep`. fp16: a tail that skipped
        (scale 0) skips the whole step, and zeros with scale 0 go down to every client."""
        inputs, outputs = self._lockstep
        del self._lockstep
        inputs, outputs = [inputs[i] for i in replied], [outputs[i] for i in replied]
        received = [self.incoming(g) for g in tail_grads]
        if any(g is None for g in received):  # a tail skipped its step (fp16: it overflowed): all skip
            self.skip()
            grads = [torch.zeros_like(z, dtype=torch.float32) for z in inputs]
        else:
            weighted = [
                (output, alpha * typing.cast(torch.Tensor, g)) for output, alpha, g in zip(outputs, alphas, received)
            ]
            with self.blueprint.timed("server"):
                self.step("server_model", functools.partial(self.backward_pass, *weighted), tuple(inputs))
                grads = [typing.cast(torch.Tensor, z.grad).float() / alpha for z, alpha in zip(inputs, alphas)]
        cut_grads = self.crossing(average_cut_grads(grads, sizes, set(averaged)))
        return {"cut_grads": [self.send_gradient(g) for g in cut_grads]}


class SGLR(PersonalClients, Algorithm[SGLRParams]):
    name = "sglr"
    supports_u_shape = True
    Server = SGLRServer
    supports_fp16 = True

    def server_steps(self, clients: list[ClientInfo]) -> dict[str, int]:
        """One server step per lockstep: as many as the most steps a client takes."""
        return {"server_model": max(self.ctx.local_steps(c) for c in clients)}

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        averaged = averaged_clients(self.ctx, rnd, clients, self.params.average_fraction)
        steps = [self.ctx.local_steps(c) for c in clients]
        for step in range(max(steps)):
            self.lockstep(step, [c for c, n in zip(clients, steps) if n > step], averaged)

    def lockstep(self, step: int, clients: list[ClientInfo], averaged: set[int]) -> None:
        """One step of the clients with batches left (those that dropped out are left out, the
        loss weights renormalised over the others); `averaged`: ids of the averaging subset."""
        clients, sent = self.forwards(clients, step)
        if not clients:
            return
        if self.ctx.config.tail_cut is not None:
            self.lockstep_u_shaped(step, clients, sent, averaged)
            return
        reply = self.server.lockstep(
            [s["smashed"] for s in sent],
            [s["labels"] for s in sent],
            self.ctx.weights(clients),
            [c.num_samples for c in clients],
            [i for i, c in enumerate(clients) if c.id in averaged],
        )
        for client, grad in zip(clients, reply["cut_grads"]):
            self.unless_dropped(client.id, "backward", step, grad)
        self.track(reply["loss"])

    def lockstep_u_shaped(self, step: int, clients: list[ClientInfo], sent: list[State], averaged: set[int]) -> None:
        """The lockstep of a U-shaped split: outputs down, each client's loss on its own labels and
        its gradient at the second cut up, one server step, cut gradients down. The loss weights
        are renormalised over the clients whose tails replied."""
        outputs = self.server.lockstep_outputs([s["smashed"] for s in sent])
        tails = [self.unless_dropped(c.id, "tail_step", step, output) for c, output in zip(clients, outputs)]
        replied = [i for i, tail in enumerate(tails) if tail is not None]
        if not replied:
            return
        clients, tails = [clients[i] for i in replied], [tails[i] for i in replied]
        alphas = self.ctx.weights(clients)
        reply = self.server.lockstep_tails(
            replied,
            [t["tail_grad"] for t in tails],
            alphas,
            [c.num_samples for c in clients],
            [i for i, c in enumerate(clients) if c.id in averaged],
        )
        for client, grad in zip(clients, reply["cut_grads"]):
            self.unless_dropped(client.id, "backward", step, grad)
        self.track(torch.stack([alpha * t["loss"] for alpha, t in zip(alphas, tails)]).sum())
