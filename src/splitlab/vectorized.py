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

The model is made of parts (`Part`): the client part, then a copy of the server part (SFL-V1,
PSL) or an auxiliary model (CSE-FSL, FSL-SAGE); a part starts from global weights, or from each
client's own (PSL's client parts, with their optimizers' state, given back after; FSL-SAGE's aux
models, held fixed). Clients that send their smashed data at some steps to a server that learns
from it without replying (CSE-FSL, FSL-SAGE) have it kept for the server, which takes it in its
own order after. SFL-V2, whose one server part replies to every step, runs `train_split`: each
step's client forward passes together, the server's steps one after another, the backward
passes together.

Equal to one client at a time within float rounding (batched products sum in another order);
only in process, where one computation can stand in for many clients' roles.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vjp, vmap
from torch.nn.utils.rnn import pad_sequence

from splitlab.errors import NonFiniteStep, UserError
from splitlab.ledger import Ledger, payload_bytes
from splitlab.privacy.defenses import decode
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
    #: by (client, step), what a client sent at the steps it sends its smashed data
    sent: dict[tuple[int, int], State]

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


@dataclass(frozen=True)
class Part:
    """A part of the model clients train together (the client's first), by its slot: every client
    starts from the same weights `start` (a global model's) or, where None, from its own in its
    node's slot, which gets the result back with its optimizer's state (PSL's client parts); a part
    not `trained` is held fixed (FSL-SAGE's auxiliary models)."""

    slot: str
    start: State | None = None
    trained: bool = True

    @property
    def continued(self) -> bool:
        """Each client's own part, trained: its weights and optimizer continue the client's, and go back to it."""
        return self.start is None and self.trained


class Together:
    """The client nodes of this process, trained a cohort at a time (Context.together)."""

    def __init__(self, blueprint: Blueprint, nodes: list[ClientNode], ledger: Ledger) -> None:
        self.blueprint, self.ledger = blueprint, ledger
        self.nodes = {node.id: node for node in nodes}
        check_model(blueprint.new_model())  # when the run is built, before anything is written
        self._models: dict[tuple[str, ...], nn.Sequential] = {}
        self._cut_bytes: int | None = None

    def model(self, slots: tuple[str, ...]) -> nn.Sequential:
        """The template the cohorts' weights run through: the modules of `slots` one after another,
        as one `nn.Sequential` (names `0.*`, `1.*`, ...)."""
        if slots not in self._models:
            self._models[slots] = nn.Sequential(*(self.blueprint.initial(slot) for slot in slots)).train()
        return self._models[slots]

    def cut_bytes(self) -> int:
        """Bytes of one sample's smashed data (the client part's output), as it crosses in float32."""
        if self._cut_bytes is None:
            client_part = self.model(("client_model",))[0]
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
        parts: list[Part],
        per_step: Callable[[int, torch.Tensor], None] | None = None,
        sends: Callable[[int], bool] | None = None,
    ) -> Iterator[Trained]:
        """Every client of `clients` trains the model made of `parts` for its round's local steps, a
        cohort at a time; `per_step(client, y)` is told of each step's targets (for the ledger). At
        the steps `sends(step)` each client sends its smashed data (the first part's output, from the
        weights it stepped from) and labels, counted as its verb would count them. Yields each
        cohort trained; the parts that are the clients' own are given back to them before."""
        model = self.model(tuple(part.slot for part in parts))
        own = [(f"{i}.", part.slot) for i, part in enumerate(parts) if part.continued]
        for cohort in self._cohorts(rnd, clients, parts, model):
            losses, sent = self._train_cohort(cohort, model, per_step, sends)
            for prefix, slot in own:
                self._give_back(cohort, slot, prefix)
            yield Trained(cohort.clients, cohort.weights, losses, sent)

    def train_split(
        self,
        rnd: int,
        clients: list[int],
        start: State,
        order: Iterable[tuple[int, int]],
        server_step: Callable[[int, State], torch.Tensor],
    ) -> list[Trained]:
        """SplitFed-v2's interleaved steps: every client of `clients` trains the client part from
        `start` for its round's local steps, each step split around the server's. At every local
        step the clients' forward passes run together (a cohort at a time), then the server takes
        their smashed data and labels one after another in `order` (client id, step: the server's
        order), `server_step(client, message)` giving back each one's cut gradient, then the
        clients' backward passes and steps run together. A client's forward pass needs only its
        own previous steps, so this is the order of one step at a time exactly; every cohort's
        weights are alive for the whole round, as every client's copy is then."""
        model = self.model(("client_model",))
        cohorts = list(self._cohorts(rnd, clients, [Part("client_model", start)], model))
        forward = vmap(lambda weights, x: _outputs(model, weights, x)[-1])
        for step, turns in itertools.groupby(order, key=lambda turn: turn[1]):
            waiting: dict[int, tuple[State, torch.Tensor, int]] = {}  # by client: its message, cut gradients, row
            backward = []
            for cohort in cohorts:
                training = sum(1 for n in cohort.steps if n > step)  # the first rows: steps sorted, most first
                if not training:
                    continue
                batches = [self.nodes[k].next_batch() for k in cohort.clients[:training]]
                x, _, _ = _padded(batches)
                rows = {name: t[:training] for name, t in cohort.weights.items()}
                smashed, pullback = vjp(lambda weights, x=x: forward(weights, x), rows)[:2]
                cut = torch.zeros_like(smashed)
                for row, (k, (_, labels)) in enumerate(zip(cohort.clients, batches)):
                    waiting[k] = {"smashed": smashed[row, : len(labels)].detach(), "labels": labels}, cut, row
                backward.append((cohort, rows, pullback, cut, training))
            for k, _ in turns:  # the server's steps, one after another in its order
                message, cut, row = waiting.pop(k)
                for kind, tensor in message.items():
                    self.count(kind, payload_bytes(tensor), k)
                grad = server_step(k, message)
                self.count("cut_grad", payload_bytes(grad), k)
                cut[row, : len(message["labels"])] = decode(grad)
            for cohort, rows, pullback, cut, training in backward:
                (grads,) = pullback(cut)
                cohort.optimizer.step(rows, grads, training)
        return [Trained(cohort.clients, cohort.weights, [], {}) for cohort in cohorts]

    def _cohorts(self, rnd: int, clients: list[int], parts: list[Part], model: nn.Sequential) -> Iterator[Cohort]:
        """`clients` sorted by their round's steps, most first, in cohorts of at most `cohort_size`
        (by default as many as fit VECTORIZE_BUDGET), each with its rows of the parts' weights
        and an optimizer over those trained (continuing the clients' own where a part is theirs)."""
        cfg = self.blueprint.config
        numel = [sum(p.numel() for p in module.parameters() if p.requires_grad) for module in model]
        trained = sum(n for part, n in zip(parts, numel) if part.trained)
        row_bytes = 4 * (trained * (4 if cfg.optimizer != "sgd" else 3) + sum(numel) - trained)
        size = cfg.cohort_size or max(1, VECTORIZE_BUDGET // row_bytes)
        steps = {k: self.blueprint.steps_per_round(cfg, self.nodes[k].num_samples) for k in clients}
        ordered = sorted(clients, key=lambda k: -steps[k])  # stable: client order among equals
        for first in range(0, len(ordered), size):
            members = ordered[first : first + size]
            weights: dict[str, torch.Tensor] = {}
            fixed: dict[str, torch.Tensor] = {}
            for i, (part, module) in enumerate(zip(parts, model)):
                for name, p in module.named_parameters():
                    if p.requires_grad:
                        (weights if part.trained else fixed)[f"{i}.{name}"] = self._rows(members, part, name, p)
            optimizer = StackedOptimizer(self.blueprint, rnd, weights)
            for i, part in enumerate(parts):
                if part.continued:
                    optimizers = [self.nodes[k].optimizer(part.slot) for k in members]
                    optimizer.load_own(f"{i}.", optimizers, self._params(members, part.slot))
            yield Cohort(members, [steps[k] for k in members], weights, fixed, optimizer)

    def _params(self, cohort: list[int], slot: str) -> list[dict[str, nn.Parameter]]:
        return [dict(self.nodes[k].model(slot).named_parameters()) for k in cohort]

    def _rows(self, cohort: list[int], part: Part, name: str, like: torch.Tensor) -> torch.Tensor:
        """Parameter `name` of `part` for every client of `cohort`, one row each."""
        if part.start is not None:
            return part.start[name].detach().unsqueeze(0).repeat(len(cohort), *[1] * like.dim())
        return torch.stack([params[name].detach() for params in self._params(cohort, part.slot)])

    def _give_back(self, cohort: Cohort, slot: str, prefix: str) -> None:
        """Each client of `cohort` gets its row of the part `prefix` back into its own `slot`, and
        its optimizer the state of that row."""
        for row, (k, params) in enumerate(zip(cohort.clients, self._params(cohort.clients, slot))):
            torch_optimizer = self.nodes[k].optimizer(slot)
            for name, param in params.items():
                with torch.no_grad():
                    param.copy_(cohort.weights[prefix + name][row])
                state = cohort.optimizer.row_state(prefix + name, row)
                if state:
                    torch_optimizer.state[param] = state

    def _train_cohort(
        self,
        cohort: Cohort,
        model: nn.Sequential,
        per_step: Callable[[int, torch.Tensor], None] | None,
        sends: Callable[[int], bool] | None,
    ) -> tuple[list[list[torch.Tensor]], dict[tuple[int, int], State]]:
        loss = self.blueprint.loss

        def client_loss(
            weights: dict[str, torch.Tensor],
            fixed: dict[str, torch.Tensor],
            x: torch.Tensor,
            y: torch.Tensor,
            w: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            """The loss of the parts one after another, and the first part's output (the smashed data)."""
            outputs = _outputs(model, {**weights, **fixed}, x)
            return loss.weighted(outputs[-1], y, w), outputs[0]

        gradient = vmap(grad_and_value(client_loss, has_aux=True))
        losses: list[list[torch.Tensor]] = [[] for _ in cohort.clients]
        sent: dict[tuple[int, int], State] = {}
        for step in range(max(cohort.steps)):
            training = sum(1 for n in cohort.steps if n > step)  # the first rows: steps sorted, most first
            batches = [self.nodes[k].next_batch() for k in cohort.clients[:training]]
            x, y, w = _padded(batches)
            rows = {name: t[:training] for name, t in cohort.weights.items()}
            fixed = {name: t[:training] for name, t in cohort.fixed.items()}
            grads, (values, smashed) = gradient(rows, fixed, x, y, w)
            cohort.optimizer.step(rows, grads, training)
            for row, (k, (_, labels)) in enumerate(zip(cohort.clients, batches)):
                losses[row].append(values[row].detach())
                if per_step is not None:
                    per_step(k, labels)
                if sends is not None and sends(step):
                    message = {"smashed": smashed[row, : len(labels)].detach().clone(), "labels": labels}
                    for kind, tensor in message.items():
                        self.count(kind, payload_bytes(tensor), k)
                    sent[k, step] = message
        finite = torch.stack([v for row in losses for v in row]).isfinite().all()
        if not bool(finite):
            value = next(float(v) for row in losses for v in row if not math.isfinite(float(v)))
            raise NonFiniteStep("loss", value)
        return losses, sent


@dataclass
class Cohort:
    """Clients trained as one: their ids (most steps first), their steps in the round, their rows
    of the weights trained and of those held fixed, and the optimizer of the former."""

    clients: list[int]
    steps: list[int]
    weights: dict[str, torch.Tensor]
    fixed: dict[str, torch.Tensor]
    optimizer: StackedOptimizer


def _outputs(model: nn.Sequential, weights: dict[str, torch.Tensor], x: torch.Tensor) -> list[torch.Tensor]:
    """The output of each part of `model` in turn, with `weights` (`<part>.<name>`; those of a
    part not given are the template's own)."""
    outputs = []
    for i, part in enumerate(model):
        prefix = f"{i}."
        x = functional_call(part, {n.removeprefix(prefix): t for n, t in weights.items() if n.startswith(prefix)}, (x,))
        outputs.append(x)
    return outputs


def _padded(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clients' batches stacked, each padded to the largest with samples weighted 0."""
    xs, ys = [x for x, _ in batches], [y for _, y in batches]
    lengths = torch.tensor([len(y) for y in ys], device=ys[0].device)
    x, y = pad_sequence(xs, batch_first=True), pad_sequence(ys, batch_first=True)
    w = (torch.arange(y.shape[1], device=y.device) < lengths[:, None]).float()
    return x, y, w


class StackedOptimizer:
    """The configured optimizer (`Blueprint.optimizer`'s: SGD, Adam, AdamW, torch's defaults and
    formulas), fresh at the round's start as a working copy's, over stacked weights: the update of
    each client is that of its own optimizer. A part that is each client's own continues the state
    of the client's optimizer (`load_own`, `row_state`: torch's). `max_grad_norm` clips each
    client's gradients by their own total norm, part by part, as `Role.clip` does slot by slot."""

    def __init__(self, blueprint: Blueprint, rnd: int, weights: dict[str, torch.Tensor]) -> None:
        cfg = blueprint.config
        self.cfg = cfg
        self.lr = cfg.lr * (blueprint.lr_factor(rnd) if blueprint.lr_schedule else 1.0)
        self.state = {name: [torch.zeros_like(w) for _ in self._moments] for name, w in weights.items()}
        #: by name, the steps each row's optimizer has taken (Adam's bias corrections)
        self.steps = {name: torch.zeros(len(w), dtype=torch.float64, device=w.device) for name, w in weights.items()}

    @property
    def _moments(self) -> tuple[str, ...]:
        """The names of the state torch's optimizer keeps per parameter (a zero momentum buffer
        steps as torch's first, which copies the gradient)."""
        if self.cfg.optimizer == "sgd":
            return ("momentum_buffer",) if self.cfg.momentum else ()
        return ("exp_avg", "exp_avg_sq")

    def load_own(
        self, prefix: str, optimizers: list[torch.optim.Optimizer], params: list[dict[str, nn.Parameter]]
    ) -> None:
        """The rows of the part `prefix` continue each client's optimizer (row by row), over its
        parameters by name (one that never stepped has no state: zeros)."""
        for row, (optimizer, named) in enumerate(zip(optimizers, params)):
            for name, param in named.items():
                state = optimizer.state.get(param, {})
                for moment, key in zip(self.state[prefix + name], self._moments):
                    if key in state:
                        moment[row] = state[key]
                self.steps[prefix + name][row] = float(state.get("step", 0))

    def row_state(self, name: str, row: int) -> State:
        """Row `row`'s state for parameter `name`, as torch's optimizer keeps it (none for plain SGD)."""
        state: State = {key: moment[row].clone() for key, moment in zip(self._moments, self.state[name])}
        if self.cfg.optimizer != "sgd":
            state["step"] = torch.tensor(float(self.steps[name][row]))
        return state

    @torch.no_grad()
    def step(self, weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], rows: int) -> None:
        cfg, lr = self.cfg, self.lr
        if cfg.max_grad_norm is not None:  # each part (`0.*`, `1.*`: a role's slot) on its own
            for part in {name.partition(".")[0] for name in grads}:
                _clip([g for name, g in grads.items() if name.partition(".")[0] == part], cfg.max_grad_norm)
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
                    g = buffer.mul_(cfg.momentum).add_(g)
                w.add_(g, alpha=-lr)
                continue
            m, v = moments
            steps = self.steps[name][:rows].add_(1)  # Adam's bias corrections (SGD keeps no count)
            beta1, beta2 = ADAM_BETAS
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            shape = (-1, *[1] * (w.dim() - 1))
            denom = (v.sqrt() / (1 - beta2**steps).sqrt().to(w.dtype).view(shape)).add_(ADAM_EPS)
            w.addcmul_(m / denom, (-lr / (1 - beta1**steps)).to(w.dtype).view(shape))


def _clip(grads: list[torch.Tensor], most: float) -> None:
    """Each row's gradients (one client's) scaled to total L2 norm at most `most`, as
    torch.nn.utils.clip_grad_norm_ computes it."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads]).norm(dim=0)
    scale = (most / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(scale.view(-1, *[1] * (g.dim() - 1)))
