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
A client steps on the gradient of the batch-mean loss, as a SplitFed server would send it back;
the alignment works with per-sample gradients (that times the batch size), so that targets and
the alignment loss do not depend on how samples are batched. Gradients are computed on copies of
BatchNorm running statistics, so estimating never changes a model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from splitlab.algorithms.base import STREAM_ALIGNMENT, Context
from splitlab.algorithms.cse_fsl import AuxiliaryFSL, CSEFSLParams
from splitlab.models.aux import smashed_shape
from splitlab.roles import Client, Part


class FSLSAGEParams(CSEFSLParams):
    align_interval: int = Field(10, ge=1, description="l: align the auxiliary models every l rounds (authors: 10)")
    lazy_until: int | None = Field(
        None, ge=0, description="T' of lazy FSL-SAGE: align only in rounds t < T' (default: every l-th round)")
    align_buffer_size: int = Field(
        1000, ge=1, description="(smashed, label) pairs the server keeps per client; the oldest go first (authors: 1000)")
    align_epochs: int = Field(5, ge=1, description="passes over a client's buffer per alignment (authors: 5)")
    align_batch_size: int = Field(100, ge=1, description="mini-batch of the alignment (authors: 100)")
    align_lr: float = Field(1e-3, gt=0, description="Adam learning rate of the alignment, without weight decay")


class AlignmentBuffer(nn.Module):
    """The latest `capacity` (smashed, label) pairs one client sent: a ring, the oldest overwritten
    first. A module of fixed-size buffers, so that checkpoints hold it like a model."""

    def __init__(self, capacity: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("smashed", torch.zeros((capacity, *shape), dtype=dtype, device=device))
        self.register_buffer("labels", torch.zeros(capacity, dtype=torch.long, device=device))
        self.register_buffer("received", torch.zeros((), dtype=torch.long, device=device))

    def add(self, smashed: torch.Tensor, labels: torch.Tensor) -> None:
        capacity = len(self.labels)
        smashed, labels = smashed[-capacity:], labels[-capacity:]
        slots = (int(self.received) + torch.arange(len(labels), device=labels.device)) % capacity
        self.smashed[slots] = smashed
        self.labels[slots] = labels
        self.received += len(labels)

    def contents(self) -> tuple[torch.Tensor, torch.Tensor]:
        stored = min(int(self.received), len(self.labels))
        return self.smashed[:stored], self.labels[:stored]


class FSLSAGE(AuxiliaryFSL):
    name = "fsl_sage"
    Params = FSLSAGEParams

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        initial = self.new_aux()
        self.aux_models = [self.working_copy(initial) for _ in ctx.clients]
        shape = smashed_shape(ctx.new_model().cpu(), ctx.config.cut, ctx.data.input_shape, ctx.data.train_x.dtype)
        self.buffers = [AlignmentBuffer(self.params.align_buffer_size, shape, torch.float32, ctx.device)
                        for _ in ctx.clients]
        self._aligning = initial  # the S-server's working copy of the aux model being aligned

    def start_client(self, slot: int, client: Client) -> tuple[Part, nn.Module]:
        return self.client_copy(slot), self.aux_models[client.id]

    def client_step(self, client: Part, aux: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.timed("client"):
            smashed = client.model(x)
            estimate = self.cut_gradient(aux, smashed, y)
            client.optimizer.zero_grad(set_to_none=True)
            smashed.backward(estimate)
            client.optimizer.step()
        return smashed.detach()

    def server_step(self, client: Client, smashed: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        received, labels = super().server_step(client, smashed, y)
        self.buffers[client.id].add(received, labels)
        return received, labels

    def finish_round(self, rnd: int, clients: list[Client], locals_: list[tuple[Part, nn.Module]]) -> None:
        self.average_client_parts(clients, [client for client, _ in locals_])
        lazy_until = self.params.lazy_until
        if rnd % self.params.align_interval == 0 and (lazy_until is None or rnd < lazy_until):
            for client in clients:
                self.align(rnd, client)

    def align(self, rnd: int, client: Client) -> None:
        """Fit the client's aux model to the server's true cut gradients on its buffer; send it down."""
        smashed, labels = self.buffers[client.id].contents()
        if len(labels) == 0:
            return
        size = self.params.align_batch_size
        with self.timed("alignment"):
            target = self.buffer_gradients(self.server.model, smashed, labels)
            aux = self._aligning
            aux.load_state_dict(self.aux_models[client.id].state_dict())
            optimizer = torch.optim.Adam(aux.parameters(), lr=self.params.align_lr, foreach=True)
            for epoch in range(self.params.align_epochs):
                order = self.ctx.rng(rnd, STREAM_ALIGNMENT, client.id, epoch).permutation(len(labels))
                for idx in torch.as_tensor(order, device=labels.device).split(size):
                    estimate = self.cut_gradient(aux, smashed[idx], labels[idx], create_graph=True) * len(idx)
                    loss = F.mse_loss(estimate, target[idx], reduction="sum") / len(idx)
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
        self.download("aux_model_down", aux, self.aux_models[client.id])

    def buffer_gradients(self, model: nn.Module, smashed: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """`model`'s per-sample cut gradients of a buffer, in mini-batches of `align_batch_size`
        (with the server part: the true z_b of the paper)."""
        size = self.params.align_batch_size
        return torch.cat([self.cut_gradient(model, z, y) * len(y) for z, y in zip(smashed.split(size), labels.split(size))])

    def cut_gradient(self, model: nn.Module, smashed: torch.Tensor, labels: torch.Tensor,
                     create_graph: bool = False) -> torch.Tensor:
        """d loss(model(z), y) / dz of the batch-mean loss, as a SplitFed server sends it back,
        leaving the model's buffers (BatchNorm statistics) as they are."""
        smashed = smashed.detach().requires_grad_()
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        logits = torch.func.functional_call(model, buffers, (smashed,))
        (grad,) = torch.autograd.grad(self.loss(logits, labels), smashed, create_graph=create_graph)
        return grad

    def estimation_error(self, client_id: int) -> float:
        """sum ||z_b_hat - z_b||^2 / sum ||z_b||^2 of the client's aux model on its buffer, with the
        current server part: the epsilon^t of the paper's Theorem 4.3, relative."""
        smashed, labels = self.buffers[client_id].contents()
        target = self.buffer_gradients(self.server.model, smashed, labels)
        estimate = self.buffer_gradients(self.aux_models[client_id], smashed, labels)
        return float(((estimate - target) ** 2).sum() / (target ** 2).sum())
