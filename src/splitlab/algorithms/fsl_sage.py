"""FSL-SAGE (Nair et al., ICML 2025, Algorithms 1-3), and its lazy variant.

Client i (Algorithm 1), every local step:
    z = client(x);  z_b_hat = d loss(aux_i(z), y) / dz      # the aux model's estimate of the cut gradient
    client <- client - lr * J^T z_b_hat                      # (Adam/SGD step); aux_i is not trained here
    at steps 0, q, 2q, ...: send (z, y) to the S-server
F-server (Algorithm 2): FedAvg of the client parts every round (weights |D_k|).
S-server (Algorithm 3): for every (z, y) received: one server step, then store it in client i's
alignment buffer (the latest `align_buffer_size` pairs; authors: 1000, oldest dropped).
At the end of every round t with t = 0 mod l (and, lazy, only while t < T' = `lazy_until`), for
each of the round's clients: recompute the true cut gradients z_b of its buffer with the current
server part, fit aux_i to them (eq. 2: min sum_j ||d loss(aux_i(z_j), y_j)/dz_j - z_b_j||^2, by
double back-propagation; `align_epochs` passes of Adam, no weight decay, over mini-batches of
`align_batch_size`), and send aux_i down. A client uses it from round t+1 on.

Auxiliary models are per client and are not averaged (the paper's F-server averages client
parts only; the authors' code agrees). The initial aux model x_a^0 is the same for every client
and derived from the seed, so it costs no traffic ("Require: x_a^0" in Algorithm 1).
With vectorize=true the clients' steps run together as the gradient of loss(aux_i(client(x)), y)
with aux_i held fixed, which is J^T z_b_hat by the chain rule (splitlab.vectorized).
A client steps on the gradient of the batch-mean loss, as a SplitFed server would send it back;
the alignment works with per-sample gradients (that times the batch size), so that targets and
the alignment loss do not depend on how samples are batched. Gradients are computed on copies of
BatchNorm running statistics, so estimating never changes a model. The S-server keeps its copy
of each client's aux model (the one it last sent) and the buffers, both made the first time a
client sends something; a buffer grows with what it holds, up to its capacity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field
from torch import nn

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.algorithms.cse_fsl import AuxiliaryFSL, CSEFSLParams
from splitlab.losses import Loss
from splitlab.models import load_shared, shared_state
from splitlab.privacy.defenses import decode
from splitlab.random_streams import register_stream
from splitlab.roles import ClientNode, State, TrainingServer, sent_if
from splitlab.transport import KEYED, verb

STREAM_ALIGNMENT = register_stream("fsl_sage.alignment", 5)


class FSLSAGEParams(CSEFSLParams):
    """CSE-FSL's keys and FSL-SAGE's own; under each, its description."""

    model_config = ConfigDict(use_attribute_docstrings=True)
    align_interval: int = Field(10, ge=1, le=1_000_000)
    """l: align the auxiliary models every l rounds (authors: 10)"""
    lazy_until: int | None = Field(None, ge=0, le=10_000_000)
    """T' of lazy FSL-SAGE: align only in rounds t < T' (default: every l-th round)"""
    align_buffer_size: int = Field(1000, ge=1, le=10_000_000)
    """(smashed, label) pairs the server keeps per client; the oldest go first (authors: 1000)"""
    align_epochs: int = Field(5, ge=1, le=100_000)
    """passes over a client's buffer per alignment (authors: 5)"""
    align_batch_size: int = Field(100, ge=1, le=1_000_000)
    """mini-batch of the alignment (authors: 100)"""
    align_lr: float = Field(1e-3, gt=0, le=1e6)
    """Adam learning rate of the alignment, without weight decay"""


def cut_gradient(
    loss: Loss,
    model: nn.Module,
    smashed: torch.Tensor,
    labels: torch.Tensor,
    create_graph: bool = False,
    scale: float = 1.0,
) -> torch.Tensor:
    """d loss(model(z), y) / dz of the batch-mean loss, as a SplitFed server sends it back,
    leaving the model's buffers (BatchNorm statistics) as they are. Taken of the loss times
    `scale` (a client's `Role.seed_scale`: under fp16 its loss scale, so that small values are not
    flushed) and divided by it in float32 (a power of two: exact)."""
    smashed = smashed.detach().requires_grad_()
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    logits = torch.func.functional_call(model, buffers, (smashed,))
    (grad,) = torch.autograd.grad(loss(logits, labels) * scale, smashed, create_graph=create_graph)
    return grad.float() / scale


class AlignmentBuffer:
    """The latest `capacity` (smashed, label) pairs one client sent: grows to `capacity` (its room
    doubling, so that a pair is copied a bounded number of times), then a ring, the oldest
    overwritten first."""

    def __init__(self, capacity: int, smashed: torch.Tensor, labels: torch.Tensor, received: int = 0) -> None:
        self.capacity, self.received, self.size = capacity, received, len(labels)
        self._smashed, self._labels = smashed, labels  # room for more than `size` pairs

    @property
    def smashed(self) -> torch.Tensor:
        return self._smashed[: self.size]

    @property
    def labels(self) -> torch.Tensor:
        return self._labels[: self.size]

    def add(self, smashed: torch.Tensor, labels: torch.Tensor) -> None:
        smashed, labels = smashed[-self.capacity :], labels[-self.capacity :]
        grow = min(self.capacity - self.size, len(labels))
        if grow:
            self._make_room(self.size + grow)
            self._smashed[self.size : self.size + grow] = smashed[:grow]
            self._labels[self.size : self.size + grow] = labels[:grow]
            self.size += grow
            self.received += grow
            smashed, labels = smashed[grow:], labels[grow:]
        if len(labels):
            slots = (self.received + torch.arange(len(labels), device=labels.device)) % self.capacity
            self._smashed[slots] = smashed
            self._labels[slots] = labels
            self.received += len(labels)

    def _make_room(self, size: int) -> None:
        if size <= len(self._labels):
            return
        room = min(self.capacity, max(size, 2 * len(self._labels)))
        smashed = self._smashed.new_empty((room, *self._smashed.shape[1:]))
        labels = self._labels.new_empty((room, *self._labels.shape[1:]))
        smashed[: self.size], labels[: self.size] = self.smashed, self.labels
        self._smashed, self._labels = smashed, labels

    def state_dict(self) -> State:
        return {"smashed": self.smashed, "labels": self.labels, "received": self.received}


class SageClient(ClientNode[FSLSAGEParams]):
    """Keeps its aux model, which only the S-server's alignment changes."""

    keeps = frozenset({"aux_model"})

    @verb(up=KEYED, keys=sent_if)
    def local_aux_step(self, send: bool) -> State:
        """A step on the aux model's estimate of the cut gradient; the smashed data if `send`."""
        x, y = self.next_batch()
        with self.blueprint.timed("client"):
            smashed = self.client_output(x)
            estimate = cut_gradient(self.blueprint.loss, self.model("aux_model"), smashed, y, scale=self.seed_scale)
            penalty = self.blueprint.defense.penalty(x, smashed)
            self.step("client_model", lambda: self.backward_pass((smashed, estimate), (penalty, None)))
        return self.release(x, y, smashed.detach())[1] if send else {}


class SageServer(TrainingServer[FSLSAGEParams]):
    """The S-server: server part, and per client an alignment buffer and the aux model it last sent."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.buffers: dict[int, AlignmentBuffer] = {}
        self.aux_models: dict[int, nn.Module] = {}

    @verb()
    def learn_from(self, client_id: int, smashed: Any, labels: torch.Tensor) -> State:
        smashed = decode(smashed)
        reply = self.learn(smashed, labels)
        if client_id not in self.buffers:
            self.buffers[client_id] = AlignmentBuffer(self.params.align_buffer_size, smashed[:0].detach(), labels[:0])
        self.buffers[client_id].add(smashed.detach(), labels)
        return reply

    def aux_model(self, client_id: int) -> nn.Module:
        if client_id not in self.aux_models:
            self.aux_models[client_id] = self.blueprint.initial("aux_model")
        return self.aux_models[client_id]

    @verb()
    def align(self, rnd: int, client_id: int) -> State | None:
        """Fit the client's aux model to the server's true cut gradients on its buffer; the result
        goes down to the client (None when the buffer is empty: nothing to fit, nothing sent)."""
        if client_id not in self.buffers:
            return None
        params, buffer = self.params, self.buffers[client_id]
        smashed, labels = buffer.smashed.float(), buffer.labels  # as received (bf16/fp16: half)
        with self.blueprint.timed("alignment", scaled=False):  # its own Adam: fp16 aligns in float32
            target = self.buffer_gradients(self.model("server_model"), smashed, labels)
            aux = self.aux_model(client_id)
            trainable = [p for p in aux.parameters() if p.requires_grad]
            optimizer = torch.optim.Adam(trainable, lr=params.align_lr, foreach=True)
            for epoch in range(params.align_epochs):
                order = self.blueprint.rng(rnd, STREAM_ALIGNMENT, client_id, epoch).permutation(len(labels))
                for idx in torch.as_tensor(order, device=labels.device).split(params.align_batch_size):
                    estimate = cut_gradient(
                        self.blueprint.loss, aux, smashed[idx], labels[idx], create_graph=True
                    ) * len(idx)
                    value = F.mse_loss(estimate, target[idx], reduction="sum") / len(idx)
                    optimizer.zero_grad(set_to_none=True)
                    value.backward()
                    optimizer.step()
        return shared_state(aux)

    def buffer_gradients(self, model: nn.Module, smashed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`model`'s per-sample cut gradients of a buffer, in mini-batches of `align_batch_size`
        (with the server part: the true z_b of the paper)."""
        size = self.params.align_batch_size
        return torch.cat(
            [
                cut_gradient(self.blueprint.loss, model, z, y) * len(y)
                for z, y in zip(smashed.split(size), labels.split(size))
            ]
        )

    @verb()
    def estimation_error(self, client_id: int) -> float:
        """sum ||z_b_hat - z_b||^2 / sum ||z_b||^2 of the client's aux model on its buffer, with the
        current server part: the epsilon^t of the paper's Theorem 4.3, relative."""
        buffer = self.buffers[client_id]
        smashed = buffer.smashed.float()
        target = self.buffer_gradients(self.model("server_model"), smashed, buffer.labels)
        estimate = self.buffer_gradients(self.aux_model(client_id), smashed, buffer.labels)
        return float(((estimate - target) ** 2).sum() / (target**2).sum())

    @verb(up="checkpoint")
    def state_dict(self) -> State:
        return {
            **super().state_dict(),
            "buffers": {k: b.state_dict() for k, b in self.buffers.items()},
            "aux_models": {k: shared_state(m) for k, m in self.aux_models.items()},
        }

    @verb(down="checkpoint")
    def load_state_dict(self, state: State) -> None:
        super().load_state_dict(state)
        capacity = self.params.align_buffer_size
        self.buffers = {
            int(k): AlignmentBuffer(capacity, b["smashed"], b["labels"], int(b["received"]))
            for k, b in state["buffers"].items()
        }
        for k, weights in state["aux_models"].items():
            load_shared(self.aux_model(int(k)), weights)


class FSLSAGE(AuxiliaryFSL, Algorithm[FSLSAGEParams]):
    name = "fsl_sage"
    supports_fp16 = True
    averaged = ("client_model",)
    Client = SageClient
    Server = SageServer

    def finish_round(self, rnd: int, clients: list[ClientInfo]) -> None:
        """The S-server's alignment of the round's clients' aux models (Algorithm 3)."""
        lazy_until = self.params.lazy_until
        if rnd % self.params.align_interval == 0 and (lazy_until is None or rnd < lazy_until):
            for client in self.finished(clients):  # one that dropped out keeps the aux model it has
                aligned = self.server.align(rnd, client.id)
                if aligned is not None:
                    self.unless_dropped(client.id, "load", "aux_model", aligned)
