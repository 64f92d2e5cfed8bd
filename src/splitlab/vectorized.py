"""Clients that run together (`vectorize=true`): the local training of a round's clients that do
not depend on each other, as one computation over their stacked weights.

Each cohort of clients starts from the same global weights, stacked along a new first dimension
(one row per client); every local step draws each client's next mini-batch from its own node
(the very batches it would draw alone), and one `torch.func.vmap` of the loss's gradient
(`functional_call` over the stacked weights) computes every client's step at once, followed by
one optimizer update of the stacked tensors. Clients whose last batch is smaller are padded with
samples weighted 0; clients are sorted by their number of steps (most first), so the clients
still training at any step are the first rows, and only those rows are computed. A cohort holds
at most `cohort_size` clients (by default as many as fit VECTORIZE_BUDGET), which bounds memory.
What each client sends and receives is counted in the ledger as its verbs would count it.

Equal to one client at a time within float rounding (batched products sum in another order);
only in process, where one computation can stand in for many clients' roles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from splitlab.errors import NonFiniteStep, UserError
from splitlab.ledger import Ledger, payload_bytes
from splitlab.roles import Blueprint, ClientNode, State

VECTORIZE_BUDGET = 1 << 30
"""Bytes of stacked weights, gradients and optimizer state one cohort may hold (cohort_size=none)."""

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8
"""torch's defaults, which `Blueprint.optimizer` keeps."""


def check_model(model: nn.Module) -> None:
    """A model vectorize=true can run, or one line: its layers must keep no state of their own
    between steps (BatchNorm's running statistics) and draw no random numbers (dropout)."""
    for name, module in model.named_modules():
        stateful = any(True for _ in module.buffers(recurse=False))
        if stateful or ("Dropout" in type(module).__name__ and getattr(module, "p", 0) > 0):
            kind = "keeps running statistics" if stateful else "draws dropout masks"
            raise UserError(
                f"vectorize=true does not apply to this model: its layer {name or type(module).__name__} "
                f"({type(module).__name__}) {kind}; vectorize=false runs it"
            )


@dataclass
class Trained:
    """A cohort after its local training: its clients (in the order of `weights`' rows) and their
    weights, each tensor stacked with one row per client."""

    clients: list[int]
    weights: dict[str, torch.Tensor]
    #: each client's steps' losses, in step order
    losses: list[list[torch.Tensor]]

    def weighted_mean(self, alphas: list[float], prefix: str) -> State:
        """sum_k alpha_k w_k / sum_k alpha_k over the cohort's clients, of the tensors named
        `prefix...` (named without it): what the cohort adds into a running average."""
        device = next(iter(self.weights.values())).device
        a = torch.tensor(alphas, dtype=torch.float32, device=device) / sum(alphas)
        return {
            name.removeprefix(prefix): torch.tensordot(a, w, dims=1)
            for name, w in self.weights.items()
            if name.startswith(prefix)
        }


class Together:
    """The client nodes of this process, trained a cohort at a time (Context.together)."""

    def __init__(self, blueprint: Blueprint, nodes: list[ClientNode], ledger: Ledger) -> None:
        self.blueprint, self.ledger = blueprint, ledger
        self.nodes = {node.id: node for node in nodes}
        check_model(blueprint.new_model())  # when the run is built, before anything is written
        self._models: dict[int, nn.Sequential] = {}
        self._cut_bytes: int | None = None

    def model(self, parts: int) -> nn.Sequential:
        """The template the cohorts' weights run through: the whole model (`parts` 1) or the
        client part then the server part (2), as one `nn.Sequential` (names `0.*`, `1.*`)."""
        if parts not in self._models:
            template = (
                nn.Sequential(self.blueprint.new_model()) if parts == 1 else nn.Sequential(*self.blueprint.new_split())
            )
            self._models[parts] = template.train()
        return self._models[parts]

    def cut_bytes(self) -> int:
        """Bytes of one sample's smashed data (the client part's output), as it crosses in float32."""
        if self._cut_bytes is None:
            client_part = self.model(2)[0]
            with torch.no_grad():
                sample = torch.zeros((1, *self.blueprint.input_shape), dtype=self.blueprint.input_dtype)
                self._cut_bytes = payload_bytes(client_part(sample.to(self.blueprint.device)))
        return self._cut_bytes

    def count(self, kind: str, nbytes: int, client: int) -> None:
        """What a client's verb would have counted."""
        self.ledger.add(kind, nbytes, client)

    def train(
        self,
        rnd: int,
        clients: list[int],
        model: nn.Module,
        start: State,
        per_step: Callable[[int, torch.Tensor], None],
    ) -> Iterator[Trained]:
        """Every client of `clients` trains `model` from `start` for its round's local steps, a
        cohort at a time; `per_step(client, y)` is told of each step's targets (for the ledger).
        Yields each cohort trained."""
        cfg = self.blueprint.config
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        names = [name for name in start if name in trainable]
        row_bytes = sum(start[n].numel() * 4 for n in names) * (4 if cfg.optimizer != "sgd" else 3)
        size = cfg.cohort_size or max(1, VECTORIZE_BUDGET // row_bytes)
        steps = {k: self.blueprint.steps_per_round(cfg, self.nodes[k].num_samples) for k in clients}
        ordered = sorted(clients, key=lambda k: -steps[k])  # stable: client order among equals
        for first in range(0, len(ordered), size):
            cohort = ordered[first : first + size]
            weights = {n: start[n].detach().unsqueeze(0).repeat(len(cohort), *[1] * start[n].dim()) for n in names}
            losses = self._train_cohort(rnd, cohort, [steps[k] for k in cohort], model, weights, per_step)
            yield Trained(cohort, weights, losses)

    def _train_cohort(
        self,
        rnd: int,
        cohort: list[int],
        steps: list[int],
        model: nn.Module,
        weights: dict[str, torch.Tensor],
        per_step: Callable[[int, torch.Tensor], None],
    ) -> list[list[torch.Tensor]]:
        blueprint = self.blueprint
        loss = blueprint.loss

        def client_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, w: torch.Tensor):
            return loss.weighted(functional_call(model, params, (x,)), y, w)

        gradient = vmap(grad_and_value(client_loss))
        optimizer = StackedOptimizer(blueprint, rnd, weights)
        losses: list[list[torch.Tensor]] = [[] for _ in cohort]
        for step in range(max(steps)):
            training = sum(1 for n in steps if n > step)  # the first rows: steps sorted, most first
            batches = [self.nodes[k].next_batch() for k in cohort[:training]]
            for k, (_, y) in zip(cohort, batches):
                per_step(k, y)
            x, y, w = _padded(batches)
            rows = {name: t[:training] for name, t in weights.items()}
            grads, values = gradient(rows, x, y, w)
            optimizer.step(rows, grads, training)
            for row, value in enumerate(values.detach()):
                losses[row].append(value)
        finite = torch.stack([v for row in losses for v in row]).isfinite().all()
        if not bool(finite):
            value = next(float(v) for row in losses for v in row if not math.isfinite(float(v)))
            raise NonFiniteStep("loss", value)
        return losses


def _padded(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clients' batches stacked, each padded to the largest with samples weighted 0."""
    largest = max(len(y) for _, y in batches)
    x0, y0 = batches[0]
    x = x0.new_zeros((len(batches), largest, *x0.shape[1:]))
    y = y0.new_zeros((len(batches), largest, *y0.shape[1:]))
    w = torch.zeros(len(batches), largest, device=y0.device)
    for row, (xs, ys) in enumerate(batches):
        x[row, : len(ys)], y[row, : len(ys)], w[row, : len(ys)] = xs, ys, 1.0
    return x, y, w


class StackedOptimizer:
    """The configured optimizer (`Blueprint.optimizer`'s: SGD, Adam, AdamW, torch's defaults and
    formulas), fresh at the round's start as a working copy's, over stacked weights: the update of
    each client is that of its own optimizer. `max_grad_norm` clips each client's gradients by
    their own total norm, part by part, as `Role.clip` does slot by slot."""

    def __init__(self, blueprint: Blueprint, rnd: int, weights: dict[str, torch.Tensor]) -> None:
        cfg = blueprint.config
        self.cfg = cfg
        self.lr = cfg.lr * (blueprint.lr_factor(rnd) if blueprint.lr_schedule else 1.0)
        self.state = {name: [torch.zeros_like(w) for _ in range(self._moments)] for name, w in weights.items()}
        self.steps = 0

    @property
    def _moments(self) -> int:
        if self.cfg.optimizer == "sgd":
            return 1 if self.cfg.momentum else 0
        return 2

    @torch.no_grad()
    def step(self, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], rows: int) -> None:
        cfg, lr = self.cfg, self.lr
        if cfg.max_grad_norm is not None:  # each part (`0.*`, `1.*`: a role's slot) on its own
            for part in {name.partition(".")[0] for name in grads}:
                _clip([g for name, g in grads.items() if name.partition(".")[0] == part], cfg.max_grad_norm)
        self.steps += 1
        for name, w in weights.items():
            g = grads[name]
            moments = [m[:rows] for m in self.state[name]]
            if cfg.optimizer == "adamw":
                w.mul_(1 - lr * cfg.weight_decay)
            elif cfg.weight_decay:
                g = g.add(w, alpha=cfg.weight_decay)
            if cfg.optimizer == "sgd":
                if moments:
                    (buffer,) = moments
                    if self.steps == 1:
                        buffer.copy_(g)
                    else:
                        buffer.mul_(cfg.momentum).add_(g)
                    g = buffer
                w.add_(g, alpha=-lr)
                continue
            m, v = moments
            beta1, beta2 = ADAM_BETAS
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v.sqrt() / math.sqrt(1 - beta2**self.steps)).add_(ADAM_EPS)
            w.addcdiv_(m, denom, value=-lr / (1 - beta1**self.steps))


def _clip(grads: list[torch.Tensor], most: float) -> None:
    """Each row's gradients (one client's) scaled to total L2 norm at most `most`, as
    torch.nn.utils.clip_grad_norm_ computes it."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads]).norm(dim=0)
    scale = (most / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *[1] * (g.dim() - 1)))
