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

U-shaped (`cut=A,B`, docs/configurations.md) the server holds only the middle and never the labels,
so each of its steps takes a trip through the tails of the clients whose samples it holds:

    server task   for each resampled server mini-batch, the middle's output goes down to the clients
                  holding its samples (each its rows); client k takes its share of the batch's
                  weighted loss, sum over its rows of |D_k| l_i divided by the whole batch's sum of
                  weights (the server sends both), so the shares add up to the vanilla loss; its
                  tail steps on it (the tail is the last layers of the vanilla server part, which
                  train in the server task) and the gradient at B goes up; the middle steps
    ServerGrad    frozen, the updated middle's output for each client's original batch goes down,
                  the client's updated tail (no step) sends back the gradient at B of its mean
                  loss, the server the cut gradient at A (averaged as SGLR for cycle_sglr)

The tail steps with the client's optimizer (its slot holds head and tail; a step touches only the
parameters that have gradients) at `lr`, not `server_lr`. Hence, with one client, U-shaped equals
vanilla at cut A (tested) when `server_lr` is unset and the tail's optimizer lives as long as the
vanilla server's: for cycle_psl and cycle_sglr (personal client parts, their optimizers kept) with
any optimizer; for cycle_sfl and cycle_ssl, whose client optimizer starts afresh every round, only
with a stateless one (SGD without momentum). A client that drops out during the server task gives
no gradient for its rows from then on and is left out of ServerGrad. For a language task the
batch's sum of weights counts every position of a sequence (the server cannot see which targets
are ignored), so there the shares add up to the vanilla loss only where no target is.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import cast

import torch
from pydantic import BaseModel, ConfigDict, Field

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.algorithms.psl import PersonalClient, PersonalClients
from splitlab.algorithms.sglr import ServerWithOwnLR, SGLRParams, average_cut_grads, averaged_clients
from splitlab.algorithms.sl import Relay, RelayClient
from splitlab.models import HeadAndTail
from splitlab.privacy.defenses import decode
from splitlab.random_streams import register_stream
from splitlab.roles import State
from splitlab.transport import KEYED, verb
from splitlab.u_shaped import UShapedClient

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


@dataclass
class PooledFeatures:
    """U-shaped: the round's pooled features, where each row came from, and the server task's batches."""

    features: list[torch.Tensor]
    sizes: list[int]
    batches: list[torch.Tensor]
    x: torch.Tensor
    weight: torch.Tensor
    #: per pooled row: the position of its client in the round, and its row in that client's batch
    owner: torch.Tensor
    row: torch.Tensor
    #: the batch awaiting the gradients at the second cut: its middle's output, and each client's positions in it
    pending: tuple[torch.Tensor, dict[int, torch.Tensor]] | None = None
    #: ServerGrad: by client position, its features and the frozen middle's output on them
    frozen: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def sample_weights(features: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Every pooled sample's loss weight: its client's |D_k|."""
    return torch.cat([torch.full((len(f),), float(n), device=f.device) for f, n in zip(features, sizes)])


class CycleServer(ServerWithOwnLR[CycleParams]):
    _pooled: PooledFeatures | None = None

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
        cut_grads = self.crossing(average_cut_grads(grads, sizes, set(averaged)))
        return {"cut_grads": [self.send_gradient(g, y) for g, y in zip(cut_grads, labels)], "losses": losses}

    def server_batches(self, rnd: int, samples: int, first_client: int, device: torch.device) -> list[torch.Tensor]:
        """The server task's mini-batches of the round's `samples` pooled samples: `server_epochs`
        resampled passes."""
        params = self.params
        batch_size = params.server_batch_size or self.blueprint.config.batch_size
        return [
            idx
            for epoch in range(params.server_epochs)
            for idx in torch.as_tensor(
                self.blueprint.rng(rnd, STREAM_SERVER_BATCHES, first_client, epoch).permutation(samples), device=device
            ).split(batch_size)
        ]

    def train_pooled(
        self, rnd: int, features: list[torch.Tensor], labels: list[torch.Tensor], sizes: list[int], first_client: int
    ) -> list[torch.Tensor]:
        """The higher-level task: resampled mini-batches of the pooled features, loss weighted by |D_k|."""
        x, y, weight = torch.cat(features), torch.cat(labels), sample_weights(features, sizes)
        model, losses = self.model("server_model"), []
        with self.blueprint.timed("server"):
            for idx in self.server_batches(rnd, len(y), first_client, x.device):
                value = self.blueprint.loss.weighted(model(x[idx]), y[idx], weight[idx])
                self.step("server_model", functools.partial(self.backward_pass, (value, None)))
                losses.append(value.detach())
        return losses

    def frozen_cut_grad(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """d loss / d features through the server, computing no gradient for its weights (of the
        loss times `seed_scale`: under fp16 it crosses scaled, as a step's, through `crossing`)."""
        features = features.detach().requires_grad_()
        value = self.blueprint.loss(self.model("server_model")(features), labels) * self.seed_scale
        return torch.autograd.grad(value, features)[0]

    # --- U-shaped: the server holds the middle, the clients' tails take the loss -------------
    @verb()
    def pool(self, rnd: int, features: list[torch.Tensor], sizes: list[int], first_client: int) -> int:
        """The server task begins: the round's features pooled and its mini-batches drawn (as
        vanilla's); how many there are."""
        features = [decode(z) for z in features]
        x = torch.cat(features)
        self._pooled = PooledFeatures(
            features,
            sizes,
            self.server_batches(rnd, len(x), first_client, x.device),
            x,
            sample_weights(features, sizes),
            torch.cat([torch.full((len(f),), k, device=x.device) for k, f in enumerate(features)]),
            torch.cat([torch.arange(len(f), device=x.device) for f in features]),
        )
        return len(self._pooled.batches)

    @verb()
    def pooled_outputs(self, batch: int) -> list[State]:
        """The middle on server mini-batch `batch`; for each client holding samples of it (its
        position `client` in the round): their rows in its batch, the middle's output for them,
        their weight |D_k| and the batch's sum of weights (`total`), so that the clients' shares of
        the loss add up to the batch's weighted loss. The step waits for the gradients (`pooled_step`)."""
        pooled = cast(PooledFeatures, self._pooled)
        idx = pooled.batches[batch]
        with self.blueprint.timed("server"):
            output = self.model("server_model")(pooled.x[idx])
        owners = pooled.owner[idx]
        positions = {k: (owners == k).nonzero().flatten() for k in owners.unique().tolist()}
        pooled.pending = output, positions
        targets = math.prod(self.blueprint.input_shape) if self.blueprint.task == "language" else 1
        total = float(pooled.weight[idx].sum()) * targets
        return [
            {
                "client": k,
                "rows": pooled.row[idx[mine]].tolist(),
                "output": output[mine].detach(),
                "weight": float(pooled.sizes[k]),
                "total": total,
            }
            for k, mine in positions.items()
        ]

    @verb()
    def pooled_step(self, clients: list[int], tail_grads: list[torch.Tensor]) -> None:
        """Step the middle through the gradients at the second cut of the clients (positions) that
        replied; the rows of one that did not get none (no reply at all: no step)."""
        pooled = cast(PooledFeatures, self._pooled)
        output, positions = cast(tuple[torch.Tensor, dict[int, torch.Tensor]], pooled.pending)
        pooled.pending = None
        if not clients:
            return
        received = [self.incoming(g) for g in tail_grads]
        if any(g is None for g in received):  # a tail skipped its step (fp16: it overflowed): so does the middle
            self.skip()
            return
        grad = torch.zeros_like(output, dtype=torch.float32)
        for k, tail_grad in zip(clients, received):
            grad[positions[k]] = cast(torch.Tensor, tail_grad)
        with self.blueprint.timed("server"):
            self.step("server_model", functools.partial(self.backward_pass, (output, grad)))

    @verb()
    def frozen_outputs(self, clients: list[int]) -> list[torch.Tensor]:
        """ServerGrad: the updated middle's output for the original batch of each client (positions),
        awaiting the gradient there (`frozen_cut_grads`)."""
        pooled = cast(PooledFeatures, self._pooled)
        model = self.model("server_model")
        with self.blueprint.timed("server"):
            for k in clients:
                features = pooled.features[k].detach().requires_grad_()
                pooled.frozen[k] = features, model(features)
        return [pooled.frozen[k][1].detach() for k in clients]

    @verb()
    def frozen_cut_grads(self, clients: list[int], tail_grads: list[torch.Tensor], averaged: list[int]) -> State:
        """Each client's (positions) cut gradient from its gradient at the second cut, computing no
        gradient for the middle's weights (averaged over the clients in `averaged`, as SGLR)."""
        pooled = cast(PooledFeatures, self._pooled)
        self._pooled = None
        received = [self.incoming(g) for g in tail_grads]
        features = [pooled.frozen[k][0] for k in clients]
        skipped = any(g is None for g in received)
        if skipped:  # a tail overflowed (fp16): no cut gradient this cycle (zeros with scale 0)
            self.skip()
            grads = [torch.zeros_like(z, dtype=torch.float32) for z in features]
        else:
            with self.blueprint.timed("server"):
                grads = [
                    torch.autograd.grad(output, z, (cast(torch.Tensor, g) * self.seed_scale).to(output.dtype))[0]
                    for (z, output), g in ((pooled.frozen[k], g) for k, g in zip(clients, received))
                ]
        chosen = {i for i, k in enumerate(clients) if k in averaged}
        averages = average_cut_grads(grads, [pooled.sizes[k] for k in clients], chosen)
        cut_grads = self.crossing(averages, fresh=not skipped)
        return {"cut_grads": [self.send_gradient(g) for g in cut_grads]}

    @verb()
    def end_round(self) -> None:
        self._pooled = None  # a U-shaped cycle whose clients all dropped out
        super().end_round()


class CycleClient(UShapedClient):
    """A client whose tail takes part in the U-shaped server task and ServerGrad."""

    @verb(down="server_output", up=KEYED, keys=("tail_grad", "loss"))
    def pooled_tail_step(self, step: int, output: torch.Tensor, rows: list[int], weight: float, total: float) -> State:
        """Server task: the tail on the server's output for `rows` of the batch of `step`, and its
        share of the server batch's loss, sum of `weight` l_i over `total`; the tail steps on it
        and the gradient at the second cut goes back with the share."""
        labels = self.tail_stash[step]
        output = self.server_output(output, len(rows), f"is not a batch of the {len(rows)} rows it names")
        if not all(0 <= r < len(labels) for r in rows):
            raise ValueError(f"the server names rows outside the batch of {len(labels)} samples of step {step}")
        model = cast(HeadAndTail, self.model("client_model"))
        targets = labels[torch.as_tensor(rows, dtype=torch.int64, device=labels.device)]
        with self.blueprint.timed("client"):
            weights = torch.full((len(rows),), float(weight), device=output.device)
            value = self.blueprint.loss.weighted(model.tail(output), targets, weights, total)
            self.step("client_model", functools.partial(self.backward_pass, (value, None)))
        (grad,) = self.crossing([cast(torch.Tensor, output.grad)])
        return {"tail_grad": self.sent(grad), "loss": value.detach()}

    @verb(down="server_output", up=KEYED, keys=("tail_grad",))
    def frozen_tail(self, step: int, output: torch.Tensor) -> State:
        """ServerGrad: the gradient at the second cut of the mean loss on the batch of `step`
        through the updated tail, which does not step; its labels are done with."""
        labels = self.tail_stash.pop(step)
        output = self.server_output(output, len(labels), f"for step {step} is not a batch of {len(labels)} samples")
        model = cast(HeadAndTail, self.model("client_model"))
        with self.blueprint.timed("client"):
            value = self.blueprint.loss(model.tail(output), labels) * self.seed_scale
            (grad,) = self.crossing([torch.autograd.grad(value, output)[0]], fresh=True)
        tail_grad = self.sent(grad)
        if self.blueprint.recorder is not None:  # the gradient as the server reads it (fp16: unscaled)
            received = self.incoming(tail_grad)
            if received is not None:
                self.blueprint.recorder.received_tail(self.id, step, received)
        return {"tail_grad": tail_grad}


class CyclePersonalClient(CycleClient, PersonalClient):
    pass


class CycleRelayClient(CycleClient, RelayClient):
    pass


class CycleSL(Algorithm):
    """Algorithm 1, for whatever holds the round's client parts."""

    Server = CycleServer
    supports_u_shape = True
    supports_fp16 = True
    no_step_schedule = "its server trains server_epochs over each cycle's pooled features, steps not known before"

    def round_batches(self, clients: list[ClientInfo]) -> int | None:
        return len(clients)  # ONE mini-batch each

    def cycle(self, rnd: int, clients: list[ClientInfo], averaged: Collection[int] = ()) -> None:
        """`averaged`: ids of the clients whose cut gradients are averaged. A client that drops
        out is left out of the pooled features (and of what follows)."""
        clients, sent = self.forwards(clients, 0)  # ClientFP
        if not clients:
            return
        smashed, sizes = [s["smashed"] for s in sent], [c.num_samples for c in clients]
        chosen = [i for i, c in enumerate(clients) if c.id in averaged]
        if self.ctx.config.tail_cut is not None:
            self.cycle_u_shaped(rnd, clients, smashed, sizes, chosen)
            return
        # server task, ServerGrad
        reply = self.server.cycle(rnd, smashed, [s["labels"] for s in sent], sizes, clients[0].id, chosen)
        for value in reply["losses"]:
            self.track(value)
        for client, grad in zip(clients, reply["cut_grads"]):  # ClientBP
            self.unless_dropped(client.id, "backward", 0, grad)

    def cycle_u_shaped(
        self, rnd: int, clients: list[ClientInfo], smashed: list, sizes: list[int], averaged: list[int]
    ) -> None:
        """The cycle of a U-shaped split: every server step, and ServerGrad, through the tails of
        the clients (positions k in `clients`) whose samples it holds."""
        for batch in range(self.server.pool(rnd, smashed, sizes, clients[0].id)):  # server task
            shares = self.server.pooled_outputs(batch)
            tails = {
                share["client"]: self.unless_dropped(
                    clients[share["client"]].id,
                    "pooled_tail_step",
                    0,
                    share["output"],
                    share["rows"],
                    share["weight"],
                    share["total"],
                )
                for share in shares
            }
            replied = {k: tail for k, tail in tails.items() if tail is not None}
            self.server.pooled_step(list(replied), [tail["tail_grad"] for tail in replied.values()])
            if replied:
                self.track(torch.stack([tail["loss"] for tail in replied.values()]).sum())
        live = [k for k, c in enumerate(clients) if c.id not in self.dropped]  # ServerGrad
        outputs = self.server.frozen_outputs(live)
        tails = {k: self.unless_dropped(clients[k].id, "frozen_tail", 0, out) for k, out in zip(live, outputs)}
        replied = {k: tail for k, tail in tails.items() if tail is not None}
        reply = self.server.frozen_cut_grads(list(replied), [tail["tail_grad"] for tail in replied.values()], averaged)
        for k, grad in zip(replied, reply["cut_grads"]):  # ClientBP
            self.unless_dropped(clients[k].id, "backward", 0, grad)


class CyclePSL(CycleSL, PersonalClients, Algorithm[CycleParams]):
    name = "cycle_psl"
    description = (
        "CycleSL over PSL (Wang, Bozkir & Kasneci, Algorithm 1): every client keeps its own client part; "
        "the server trains on the round's pooled features."
    )
    Client = CyclePersonalClient

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        self.cycle(rnd, clients)


class CycleSGLR(CycleSL, PersonalClients, Algorithm[CycleSGLRParams]):
    name = "cycle_sglr"
    description = (
        "CycleSL over SGLR (Wang, Bozkir & Kasneci): personal client parts, the cut gradients of the cycle "
        "averaged over a subset of the clients as in SGLR."
    )
    Client = CyclePersonalClient

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        self.cycle(rnd, clients, averaged_clients(self.ctx, rnd, clients, self.params.average_fraction))


class CycleSFL(CycleSL, Algorithm[CycleParams]):
    name = "cycle_sfl"
    description = (
        "CycleSL over SFL (Wang, Bozkir & Kasneci): per-round copies of the client part, averaged (FedAvg) "
        "after the round's cycle."
    )
    Client = CycleClient
    averaged = ("client_model",)

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client in clients:  # one live copy per sampled client (graphs kept)
            self.download(client.id)
        self.cycle(rnd, clients)
        self.federated_average(clients)


class CycleSSL(CycleSL, Relay, Algorithm[CycleParams]):
    """Sequential SL with the cycle update: clients in id order, each one cycle on its own batch."""

    name = "cycle_ssl"
    description = (
        "CycleSL over sequential SL (Wang, Bozkir & Kasneci): one client part relayed from client to client "
        "in id order, each client a cycle on its own batch."
    )
    Client = CycleRelayClient

    def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        for client in clients:
            self.hand_to(client.id)
            self.cycle(rnd, [client])
