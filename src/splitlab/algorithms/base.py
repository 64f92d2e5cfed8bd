"""What every algorithm shares: the run context, the split training step and FedAvg plumbing.

An algorithm file subclasses `Algorithm`, builds its models in `__init__`, and says in
`train_round` what one round does. Loop, evaluation, checkpoints and logging are the engine's.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel
from torch import nn

from splitlab.channel import Channel
from splitlab.config import NoParams, RunConfig
from splitlab.data import Dataset
from splitlab.models import StagedModel, build_model, split
from splitlab.roles import Client, ModelAverage, Part

# Purposes of the per-round random streams, so that no two uses share one.
STREAM_SAMPLING, STREAM_BATCHES, STREAM_ORDER = 0, 1, 2
STREAM_SUBSET, STREAM_SERVER_BATCHES = 3, 4  # SGLR's averaged clients; CycleSL's resampled batches
STREAM_ALIGNMENT = 5  # FSL-SAGE's alignment mini-batches


@dataclass
class Context:
    """Everything an algorithm may use: settings, data (on the device), clients and the channel."""

    config: RunConfig
    params: BaseModel
    data: Dataset
    clients: list[Client]
    channel: Channel
    device: torch.device

    def new_model(self) -> StagedModel:
        """The initial global model: every call returns the same weights (seeded by `seed`)."""
        return build_model(self.config.model, self.data.input_shape, self.data.num_classes,
                           seed=self.config.seed).to(self.device)

    def new_split(self) -> tuple[nn.Sequential, nn.Sequential]:
        return split(self.new_model(), self.config.cut)

    def rng(self, rnd: int, stream: int, *keys: int) -> np.random.Generator:
        """A random stream that depends only on (seed, round, purpose, keys): resumable by design."""
        return np.random.default_rng([self.config.seed, rnd, stream, *keys])

    def optimizer(self, module: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """The configured optimizer over `module`, with multi-tensor kernels (never one per batch)."""
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        params = [p for p in module.parameters() if p.requires_grad]
        if cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay, foreach=True)
        return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                               foreach=True)

    def part(self, module: nn.Module, lr: float | None = None) -> Part:
        return Part(module, self.optimizer(module, lr))

    def batches(self, client: Client, rnd: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The client's mini-batches for this round: `local_epochs` seeded passes over its data."""
        orders = [self.rng(rnd, STREAM_BATCHES, client.id, epoch).permutation(client.num_samples)
                  for epoch in range(self.config.local_epochs)]
        batches = client.batches(self.data.train_x, self.data.train_y, self.config.batch_size, orders)
        return itertools.islice(batches, self.local_steps(client))

    def local_steps(self, client: Client) -> int:
        """How many mini-batches the client takes this round: its epochs, capped by `local_steps`."""
        steps = math.ceil(client.num_samples / self.config.batch_size) * self.config.local_epochs
        return min(steps, self.config.local_steps or steps)

    def interleaved(self, rnd: int, clients: list[Client]) -> Iterator[tuple[int, int, tuple]]:
        """(k, step, batch) in SplitFed-v2's interleaved order (cut-layer paper, Algorithm 2):
        at every local step, the clients with batches left go in a fresh random order."""
        batches = [self.batches(client, rnd) for client in clients]
        steps = [self.local_steps(c) for c in clients]
        for step in range(max(steps, default=0)):
            active = [k for k, n in enumerate(steps) if n > step]
            for k in self.rng(rnd, STREAM_ORDER, step).permutation(active):
                yield int(k), step, next(batches[k])

    def weights(self, clients: list[Client]) -> list[float]:
        """FedAvg weights alpha_k = |D_k| / sum of |D_i| over the round's clients."""
        total = sum(c.num_samples for c in clients)
        return [c.num_samples / total for c in clients]


class Algorithm:
    """Base class. Subclasses set `name`, optionally `Params`, and implement `train_round`."""

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = NoParams
    #: True when every client keeps its own client part (PSL, SGLR): there is no one global model,
    #: so evaluation averages over clients, each through `predict_for_client`.
    personal_models: ClassVar[bool] = False

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.channel = ctx.channel
        self.params = ctx.params
        self._loss_sum = torch.zeros((), device=ctx.device)
        self._loss_count = 0
        self._seconds: dict[str, float] = defaultdict(float)

    # --- what a subclass provides ---------------------------------------------------------
    def train_round(self, rnd: int, clients: list[Client]) -> None:
        raise NotImplementedError

    def global_parts(self) -> list[nn.Module] | None:
        """The parts that make the one global model, client side first; None if there is none."""
        return None

    def client_weights(self) -> dict[str, torch.Tensor] | None:
        """Per-client (personalized) weights a finished run keeps, as `clients.safetensors`; None if none."""
        return None

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the model that is evaluated on the global test set."""
        parts = self.global_parts()
        if parts is None:
            raise NotImplementedError(f"{self.name} must implement predict()")
        for part in parts:
            x = part(x)
        return x

    def predict_for_client(self, client_id: int, x: torch.Tensor) -> torch.Tensor:
        """Logits of the model client `client_id` would use; by default the one global model."""
        return self.predict(x)

    # --- shared steps ------------------------------------------------------------------------
    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, labels)

    def local_step(self, part: Part, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One ordinary SGD/Adam step of a whole model on a batch (FedAvg, centralized)."""
        with self.timed("client"):
            loss = self.loss(part.model(x), y)
            part.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            part.optimizer.step()
        return self.track(loss)

    def split_step(self, client: Part, server: Part, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One split-learning step: smashed data up, server step, cut-layer gradient down, client step."""
        with self.timed("client"):
            smashed = client.model(x)
        received = self.channel.send("smashed", smashed).requires_grad_()
        labels = self.channel.send("labels", y)
        with self.timed("server"):
            loss = self.loss(server.model(received), labels)
            server.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            server.optimizer.step()
        cut_grad = self.channel.send("cut_grad", received.grad)
        with self.timed("client"):
            client.optimizer.zero_grad(set_to_none=True)
            smashed.backward(cut_grad)
            client.optimizer.step()
        return self.track(loss)

    def download(self, kind: str, source: nn.Module, target: nn.Module) -> None:
        """Copy `source`'s weights into `target` across the channel (counted as `kind`)."""
        target.load_state_dict(self.channel.send(kind, source.state_dict()))

    def average_into(self, target: nn.Module, average: ModelAverage) -> None:
        target.load_state_dict(average.result(target.state_dict()))

    @staticmethod
    def working_copy(module: nn.Module) -> nn.Module:
        """A second module of the same shape, loaded from the global one before each use."""
        return copy.deepcopy(module)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        """Add the wall time of the block to `phase` ("client", "server", "alignment", ...).

        On a GPU the time is that of launching the work, not of finishing it, unless the block
        ends with a synchronising call; the figures are meant for CPU runs and for proportions.
        """
        started = time.perf_counter()
        try:
            yield
        finally:
            self._seconds[phase] += time.perf_counter() - started

    def pop_compute_seconds(self) -> dict[str, float]:
        """Seconds per phase since the last call (read once per round)."""
        seconds, self._seconds = dict(self._seconds), defaultdict(float)
        return seconds

    def track(self, loss: torch.Tensor) -> torch.Tensor:
        self._loss_sum += loss.detach()
        self._loss_count += 1
        return loss

    def pop_train_loss(self) -> float | None:
        """Mean training loss over the steps since the last call (read once per round)."""
        if self._loss_count == 0:
            return None
        mean = float(self._loss_sum) / self._loss_count
        self._loss_sum.zero_()
        self._loss_count = 0
        return mean

    # --- checkpointing ------------------------------------------------------------------------
    def _held(self) -> Iterator[tuple[str, object]]:
        """(name, object) for every model and optimizer held, directly, in a Part or in a list."""
        for name, value in vars(self).items():
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, Part):
                    yield f"{name}.{i}.model", item.model
                    yield f"{name}.{i}.optimizer", item.optimizer
                elif isinstance(item, (nn.Module, torch.optim.Optimizer)):
                    yield f"{name}.{i}", item

    def modules(self) -> list[nn.Module]:
        """All models held, scratch copies included (the engine switches them to eval mode)."""
        return [obj for _, obj in self._held() if isinstance(obj, nn.Module)]

    def _stateful(self) -> dict[str, object]:
        """What a checkpoint holds. Attributes named with a leading underscore are scratch space
        (working copies reloaded every round) and are left out."""
        return {name: obj for name, obj in self._held() if not name.startswith("_")}

    def state_dict(self) -> dict[str, object]:
        return {name: obj.state_dict() for name, obj in self._stateful().items()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        stateful = self._stateful()
        if set(stateful) != set(state):
            raise ValueError(f"checkpoint does not match {self.name}: {sorted(set(stateful) ^ set(state))}")
        for name, obj in stateful.items():
            obj.load_state_dict(state[name])
