"""The three roles of split federated learning, each the only owner of its state.

- `ClientNode`: one client's private samples, its model slots (client part, auxiliary model,
  exit head) with their optimizers, and the activations waiting for their cut gradient.
- `TrainingServer`: the server part(s), their optimizers, and whatever the algorithm keeps there.
- `SyncServer`: the global models the clients start from, and their federated averages.

A slot is a named model ("client_model", "aux_model", "server_model", ...) with its optimizer;
a slot named like a ledger kind's model ("client_model" -> client_model_down/_up) travels under
that kind. Algorithms reach roles only through `splitlab.transport` proxies, which expose the
methods marked `@verb`. Everything a role builds from the configuration alone (initial weights,
optimizers, random streams) comes from its `Blueprint`, which every process can make for itself.
An algorithm with role-side behaviour of its own subclasses a role in the algorithm's file.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar, cast

import numpy as np
import torch
from pydantic import BaseModel
from torch import nn
from torch.nn.utils import get_total_norm

from splitlab.augment import STREAM_AUGMENT, Augmentation, augmented, parse_augment
from splitlab.config import RunConfig
from splitlab.errors import NonFiniteStep
from splitlab.loss_scale import LossScale, outgoing, scaled, unscaled
from splitlab.losses import Loss, parse_loss
from splitlab.metrics import logits_in_batches
from splitlab.models import (
    StagedModel,
    build_model,
    largest_activation_bytes,
    load_shared,
    packed,
    share_frozen_copy,
    shared_state,
    split,
)
from splitlab.models.lora import load_init
from splitlab.models.trainable import hold_frozen_in
from splitlab.optimizers import PlainSGD
from splitlab.privacy import defenses, keys
from splitlab.privacy.defenses import Defense, decode
from splitlab.privacy.record import Recorder
from splitlab.process_settings import training_device
from splitlab.random_streams import register_stream
from splitlab.schedules import Factor, lr_factor, parse_lr_schedule, step_factor, warmup_length
from splitlab.secure_aggregation import ClientSecrets, MaskedSum, flat, unflat
from splitlab.strategies import LocalTerms, ServerOptimizer, trainable, zeros_like
from splitlab.targets import IGNORED
from splitlab.transport import KEYED, verb

STREAM_BATCHES = register_stream("batches", 1)

State = dict[str, Any]
SENT = ("smashed", "labels")
"""What a client's release of smashed data holds (`ClientNode.release`)."""


STEP_FIGURES = ("loss", "gradient norm", "cut-layer gradient norm")
"""What a training server checks of each step (`TrainingServer.step`), in order."""


def sent_if(send: bool) -> tuple[str, ...]:
    """The keys of a local step's result that sends its smashed data only if asked (`send`)."""
    return SENT if send else ()


ParamsT = TypeVar("ParamsT", bound=BaseModel)


def random_stream(seed: int, rnd: int, stream: int, *keys: int) -> np.random.Generator:
    """A random stream that depends only on (seed, round, purpose, keys): resumable by design."""
    return np.random.default_rng([seed, rnd, stream, *keys])


#: `precision=` -> the dtype of autocast and of what crosses a cut (fp32: none, as computed)
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}

INFERENCE_BUDGET = {"cpu": 32 * 2**20, "cuda": 256 * 2**20}
"""Bytes of the largest layer output one inference batch may hold, by device type (others: the
CPU's). On a CPU, cache-sized batches run as fast as large ones (the LEAF CNN over 10k test
images: 5.0 s in batches of 256, 6.7 s in batches of 2048) and keep evaluation from raising a
run's peak memory (batches of 2048 added 457 MB to a 12k-sample Fashion-MNIST run)."""


PREPARED_BUDGET = 512 << 20
"""Bytes of prepared samples (normalised float images) the clients of one process keep across
rounds: all of Fashion-MNIST's 60,000 (188 MB); a larger dataset's first clients' samples."""


@dataclass
class Blueprint:
    """What any role can build from the run's configuration alone, identically in every process."""

    config: RunConfig
    params: BaseModel
    device: torch.device
    input_shape: tuple[int, ...]
    num_classes: int
    input_dtype: torch.dtype
    #: the dataset's task (`Dataset.task`): what a batch's targets are, for what checks them (splitlab.net)
    task: str = "classification"
    #: slot -> how its initial model is built (the algorithm's `models` table)
    builders: Mapping[str, Callable[[Blueprint], nn.Module]] = field(default_factory=dict)
    #: the client slots the sync server averages (the algorithm's `averaged`): those FedProx and SCAFFOLD reach
    averaged: tuple[str, ...] = ()
    #: what `splitlab.models.build_model` takes beyond the data: the model's own keys and LoRA's
    model_settings: Mapping[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    #: `record=`: where clients note what crosses the cut (one process only); None when not recording
    recorder: Recorder | None = None
    #: this process's parties' noise secret (splitlab.privacy.keys); set by whoever builds the roles
    noise_secret: bytes | None = None
    #: `init=RUN_DIR`: the finished run's weights every model starts from (splitlab.run_weights.init_state),
    #: loaded by whoever builds the blueprint
    init_state: Mapping[str, torch.Tensor] | None = None
    #: called as a client of this process draws a mini-batch: progress within a round (splitlab.callbacks)
    on_batch: Callable[[], None] | None = None
    _initial: dict[str, nn.Module] = field(default_factory=dict)
    _pools: dict[str, list[nn.Module]] = field(default_factory=dict)
    _stateless: weakref.WeakKeyDictionary[nn.Module, dict[float | None, torch.optim.Optimizer]] = field(
        default_factory=weakref.WeakKeyDictionary
    )
    #: bytes of clients' samples held prepared across rounds in this process (`keep_prepared`)
    _prepared_bytes: int = 0

    def __post_init__(self) -> None:
        training_device(self.device, self.config.deterministic)  # deterministic=false: this process's kernels

    @functools.cached_property
    def lr_schedule(self) -> list[Factor]:
        """The factors of `lr_schedule=` (none: empty, and optimizers are left at their lr)."""
        return parse_lr_schedule(self.config.lr_schedule)

    @property
    def scheduled(self) -> bool:
        """Whether optimizers follow a schedule (by round, by step or both), set at every step."""
        return bool(self.lr_schedule) or self.config.lr_by_step

    def lr_factor(self, rnd: int, step: int = 0, steps: int = 1) -> float:
        """The factor of lr in round `rnd` (from 0) at a role's `step` (from 0) of the `steps` it
        takes in a round (splitlab.schedules: by round, then by step)."""
        factor = lr_factor(self.lr_schedule, rnd, self.config.rounds)
        if self.config.lr_by_step:
            cfg, total = self.config, self.config.rounds * steps
            warmup = warmup_length(cfg.warmup_steps, cfg.warmup_ratio, total)
            factor *= step_factor(rnd * steps + min(step, steps - 1), total, warmup, cfg.lr_decay)
        return factor

    @functools.cached_property
    def loss(self) -> Loss:
        """The `loss=` every role trains with (splitlab.losses): `loss(logits, targets)`, `loss.weighted(...)`."""
        return parse_loss(self.config.loss)

    @functools.cached_property
    def augment(self) -> list[Augmentation]:
        """The `augment=` every client applies to its training batches (splitlab.augment)."""
        return parse_augment(self.config.augment)

    @functools.cached_property
    def defense(self) -> Defense:
        """The `defense=` every client applies at the cut (and both sides' wire compression),
        `dp:epsilon=E` calibrated to its noise."""
        from splitlab.privacy.accounting import run_defense

        return run_defense(self.config)

    def new_model(self) -> StagedModel:
        """The initial global model: every call returns the same weights (seeded by `seed`), and
        all of them share one frozen base (LoRA), which this process therefore holds once."""
        return share_frozen_copy(self._base)

    @functools.cached_property
    def _base(self) -> StagedModel:
        return self.build_model().to(self.device)

    def build_model(self) -> StagedModel:
        """The configured model on the CPU, with the settings of its own the config gives (and the
        weights of the finished run `init` names)."""
        model = build_model(
            self.config.model, self.input_shape, self.num_classes, seed=self.config.seed, **self.model_settings
        )
        if self.config.init is not None:
            if self.init_state is None:
                raise RuntimeError(f"init={self.config.init}: the blueprint was built without its init_state")
            load_init(model, self.init_state, f"init={self.config.init}")
        if self.config.base_dtype == "bfloat16":
            hold_frozen_in(model, torch.bfloat16)
        model.checkpointed = self.config.gradient_checkpointing
        return model

    @functools.cached_property
    def inference_batch(self) -> int:
        """Samples per inference batch: as many as keep the largest layer output within
        the device's INFERENCE_BUDGET (a power of two, 16 to 4096), so that a deep model on large
        images does not exhaust memory and a small one is not run in slivers."""
        model = self.build_model()
        per_sample = largest_activation_bytes(model, self.input_shape, self.input_dtype)
        budget = INFERENCE_BUDGET.get(self.device.type, INFERENCE_BUDGET["cpu"])
        fitting = max(16, min(4096, budget // per_sample))
        return 1 << (fitting.bit_length() - 1)

    def new_split(self) -> tuple[nn.Sequential, nn.Sequential]:
        """(client part, server part) at the run's cut; U-shaped (`tail_cut`): the client part is
        the head and the tail (`HeadAndTail`), the server part the stages between."""
        return split(self.new_model(), self.config.cut, self.config.tail_cut)

    def initial(self, slot: str) -> nn.Module:
        """A new module for `slot` with its initial weights (built once, then copied; a frozen base
        is shared, not copied)."""
        return share_frozen_copy(self._initial_module(slot))

    def initial_state(self, slot: str) -> dict[str, torch.Tensor]:
        """`slot`'s initial weights (without a frozen base), read-only: no copy is made."""
        return shared_state(self._initial_module(slot))

    def _initial_module(self, slot: str) -> nn.Module:
        if slot not in self._initial:
            if slot not in self.builders:
                raise KeyError(f"no model is defined for slot {slot!r}; defined: {', '.join(self.builders)}")
            self._initial[slot] = self.builders[slot](self)
        return self._initial[slot]

    def keep_prepared(self, owner: object, samples: torch.Tensor) -> bool:
        """Whether client `owner` may keep its samples prepared (as model inputs) from round to
        round: while this process's clients hold under PREPARED_BUDGET bytes of them (a client
        gone, on Ray moved to another actor, gives its share back). Kept, a client visited again
        prepares nothing; beyond the budget, it prepares them again at each visit."""
        if self._prepared_bytes + samples.nbytes > PREPARED_BUDGET:
            return False
        self._prepared_bytes += samples.nbytes
        weakref.finalize(owner, self._release_prepared, samples.nbytes)
        return True

    def _release_prepared(self, nbytes: int) -> None:
        self._prepared_bytes -= nbytes

    def rng(self, rnd: int, stream: int, *keys: int) -> np.random.Generator:
        return random_stream(self.config.seed, rnd, stream, *keys)

    def optimizer(self, module: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """The configured optimizer over `module`, with multi-tensor kernels (never one per batch)."""
        cfg = self.config
        lr = cfg.lr if lr is None else lr
        params = [p for p in module.parameters() if p.requires_grad]
        if cfg.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay, foreach=True)
        if cfg.optimizer == "adamw":
            return torch.optim.AdamW(params, lr=lr, weight_decay=cfg.weight_decay, foreach=True)
        return PlainSGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, foreach=True)

    def working_optimizer(self, module: nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
        """The optimizer of a working copy, which starts afresh at every visit: a new one, except
        plain SGD (no momentum), whose step keeps no state, so the one made for this module before
        is as good as new and costs nothing to make again."""
        if self.config.optimizer != "sgd" or self.config.momentum != 0:
            return self.optimizer(module, lr)
        made = self._stateless.setdefault(module, {})
        if lr not in made:
            made[lr] = self.optimizer(module, lr)
        return made[lr]

    @staticmethod
    def step_batch(cfg: RunConfig) -> int:
        """Samples per optimizer step: `grad_accum` micro-batches of `batch_size`."""
        return cfg.batch_size * cfg.grad_accum

    @staticmethod
    def steps_per_round(cfg: RunConfig, num_samples: int) -> int:
        """How many steps a client takes in a round: its epochs, capped by `local_steps`."""
        steps = math.ceil(num_samples / Blueprint.step_batch(cfg)) * cfg.local_epochs
        return min(steps, cfg.local_steps or steps)

    @staticmethod
    def samples_per_round(cfg: RunConfig, num_samples: int) -> int:
        """How many samples a client trains on in a round: those of its `steps_per_round` batches
        (an epoch's last batch holds what is left)."""
        size = Blueprint.step_batch(cfg)
        full, rest = divmod(num_samples, size)
        epoch = [size] * full + ([rest] if rest else [])
        whole, part = divmod(Blueprint.steps_per_round(cfg, num_samples), max(1, len(epoch)))
        return whole * num_samples + sum(epoch[:part])

    @functools.cached_property
    def cut_dtype(self) -> torch.dtype | None:
        """The dtype hidden states and their gradients cross a cut in (`precision=`; None: as computed)."""
        return HALF.get(self.config.precision)

    def autocast(self, scaled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """The run's precision for the block: bf16 and fp16, torch's autocast in that dtype (weights
        and their gradients stay float32); fp32, nothing. `scaled=False`: a computation that no loss
        scale covers (its own optimizer, outside a role's step: FSL-SAGE's alignment), which fp16
        would flush to zero, runs in float32 there; bf16, float32's range, keeps its autocast."""
        if self.cut_dtype is None or (not scaled and self.cut_dtype == torch.float16):
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.cut_dtype)

    def logits(self, predict: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """`predict` on `x` in inference batches, in the run's precision: every evaluation, in the
        driver, on a Ray actor or in a role, computes its logits here, as the model trained."""
        with self.autocast():
            return logits_in_batches(predict, x, self.inference_batch)

    def borrow(self, slot: str, make: Callable[[], nn.Module]) -> nn.Module:
        """A scratch module for `slot` from this process's pool (made if the pool is empty): working
        copies are reused across rounds and clients, so memory follows the copies alive at once."""
        pool = self._pools.setdefault(slot, [])
        return pool.pop() if pool else make()

    def give_back(self, slot: str, module: nn.Module) -> None:
        self._pools.setdefault(slot, []).append(module)

    @contextlib.contextmanager
    def timed(self, phase: str, scaled: bool = True) -> Iterator[None]:
        """A role's computation: its wall time added to `phase` ("client", "server", "alignment",
        ...), and run in the run's precision (`autocast`, `scaled` as there), which every role's
        forward and loss thus share. On a GPU the time is that to launch the work; the figures are
        meant for CPU runs and proportions."""
        started = time.perf_counter()
        try:
            with self.autocast(scaled):
                yield
        finally:
            self.seconds[phase] += time.perf_counter() - started

    def pop_seconds(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds


def client_part(blueprint: Blueprint) -> nn.Module:
    return blueprint.new_split()[0]


def server_part(blueprint: Blueprint) -> nn.Module:
    return blueprint.new_split()[1]


def whole_model(blueprint: Blueprint) -> nn.Module:
    return blueprint.new_model()


#: The slots of split learning: the client part clients train and the sync server averages, the
#: server part, and the training server's per-client working copies of it.
SPLIT_MODELS: dict[str, Callable[[Blueprint], nn.Module]] = {
    "client_model": client_part,
    "server_model": server_part,
    "server_copy": server_part,
}


def server_copy(client_id: int) -> str:
    """The training server's slot for client `client_id`'s working copy of the server part."""
    return f"server_copy@{client_id}"


def pooled(slot: str) -> str:
    """The slot whose model and pool a working copy uses: `server_copy@3` -> `server_copy`."""
    return slot.partition("@")[0]


class ModelAverage:
    """FedAvg: sum_k alpha_k * w_k accumulated one model at a time.

    Keeping a running sum instead of K state dicts is what keeps memory flat in K. The caller
    passes normalised weights alpha_k (summing to 1), so one client with alpha = 1 is returned
    bit for bit. Integer buffers (BatchNorm's batch counters) are averaged and rounded.
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] | None = None
        self._weight = 0.0  # sum of the alphas added
        self.incomplete = False  # a contribution will not come: renormalise over those added

    def add(self, state: Mapping[str, torch.Tensor], alpha: float) -> None:
        self._weight += alpha
        values = [_as_float(v) for v in state.values()]
        if self._sum is None:
            self._sum = dict(zip(state, torch._foreach_mul(values, alpha)))
        else:  # one call for every tensor (the same sums as one add_ each)
            torch._foreach_add_([self._sum[k] for k in state], values, alpha=alpha)

    @property
    def empty(self) -> bool:
        return self._sum is None

    def result(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The average, cast back to the dtypes of `like` (usually the global model's state)."""
        if self._sum is None:
            raise RuntimeError("no model was added to the average")
        total = {k: v / self._weight for k, v in self._sum.items()} if self.incomplete else self._sum
        return {k: (total[k].round() if not v.is_floating_point() else total[k]).to(v.dtype) for k, v in like.items()}


def _as_float(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.is_floating_point() else t.detach().double()


class Role(Generic[ParamsT]):
    """Model slots with their optimizers, owned by one role (`Role[MyParams]`: the algorithm's settings).

    A slot filled by `load_copy` is a working copy (scratch): it comes from the blueprint's pool,
    gets a fresh optimizer, goes back at `end_round` and is not part of the role's state. Any
    other slot is the role's own for the whole run and starts from the initial weights.
    """

    #: slots that are the role's own for the whole run: a model received into one replaces its weights
    keeps: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, blueprint: Blueprint) -> None:
        self.blueprint = blueprint
        self.params = cast(ParamsT, blueprint.params)
        self.models: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.scratch: set[str] = set()
        self.round = 0
        #: precision=fp16: this role's loss scale, over every slot it trains (splitlab.loss_scale)
        self.loss_scale = LossScale() if blueprint.config.precision == "fp16" else None
        self._seeded = False  # whether the step's backward pass went through `backward_pass` (fp16's guard)
        #: by slot, the optimizer steps this role took in the round so far, of the `round_steps` it
        #: takes in one (`slot_steps` where a slot's differ): its place in a per-step schedule
        #: (splitlab.schedules). By slot, so that clients training at once (on Ray) each count
        #: their own server copy's steps, whatever the order they come in.
        self.steps_taken: dict[str, int] = defaultdict(int)
        self.round_steps = 1
        self.slot_steps: dict[str, int] = {}
        #: clip_scope=global: the norm of the other parts of the step's model, given before the
        #: step, and then this role's own (`clip_whole`)
        self.other_norm: torch.Tensor | None = None
        self.own_norm: torch.Tensor | None = None

    def lr(self, slot: str) -> float | None:
        """The learning rate of `slot`'s optimizer (None: the configured `lr`)."""
        return None

    def model(self, slot: str) -> nn.Module:
        if slot not in self.models:
            self.models[slot] = self.blueprint.initial(slot)
        return self.models[slot]

    def optimizer(self, slot: str) -> torch.optim.Optimizer:
        """`slot`'s optimizer, its learning rate that of the current round and step (lr_schedule=,
        warmup_steps=, lr_decay=)."""
        if slot not in self.optimizers:
            self.optimizers[slot] = self.new_optimizer(slot)
        optimizer = self.optimizers[slot]
        if self.blueprint.scheduled:
            steps = self.slot_steps.get(slot, self.round_steps)
            factor = self.blueprint.lr_factor(self.round, self.steps_taken[slot], steps)
            for group in optimizer.param_groups:
                group["lr"] = group.setdefault("initial_lr", group["lr"]) * factor
        return optimizer

    def new_optimizer(self, slot: str) -> torch.optim.Optimizer:
        """A fresh optimizer for `slot` (a working copy's: `Blueprint.working_optimizer`)."""
        make = self.blueprint.working_optimizer if slot in self.scratch else self.blueprint.optimizer
        return make(self.model(slot), self.lr(slot))

    @verb()
    def begin_round(self, rnd: int) -> None:
        """Round `rnd` begins: the learning rate follows it (called on servers only with a schedule)."""
        self.round = rnd
        self.steps_taken.clear()

    def load_copy(self, slot: str, state: Mapping[str, torch.Tensor]) -> None:
        """Make `slot` a working copy of `state` (or, a kept slot, hold `state`), with a fresh optimizer.
        `<slot>@<key>` is one of several working copies of `<slot>` alive at once (one per client)."""
        if slot not in self.models and slot not in self.keeps:
            kind = pooled(slot)
            self.models[slot] = self.blueprint.borrow(kind, lambda: self.blueprint.initial(kind))
            self.scratch.add(slot)
        load_shared(self.model(slot), state)
        self.drop_optimizer(slot)

    def return_copy(self, slot: str) -> None:
        """Give the working copy in `slot` back to the pool now."""
        self.blueprint.give_back(pooled(slot), self.models.pop(slot))
        self.drop_optimizer(slot)
        self.scratch.discard(slot)

    def drop_optimizer(self, slot: str) -> None:
        """`slot`'s optimizer is done with (its model replaced or given back)."""
        self.optimizers.pop(slot, None)

    def step(self, slot: str, backward: Callable[[], Any]) -> Any:
        """One optimizer step of `slot` on the gradients `backward` computes; what it returns."""
        return self.steps((slot,), backward)

    def steps(self, slots: tuple[str, ...], backward: Callable[[], Any]) -> Any:
        """One optimizer step of each of `slots` on the gradients `backward` computes for all of
        them at once, each clipped first (`max_grad_norm`); what `backward` returns."""
        optimizers = [self.optimizer(slot) for slot in slots]
        for slot in slots:
            self.steps_taken[slot] += 1
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        result = backward()
        if not self.unscale_for_step(slots):
            for optimizer in optimizers:  # fp16: a step that overflowed is skipped
                optimizer.zero_grad(set_to_none=True)
            return result
        if self.other_norm is not None:  # clip_scope=global: the whole model's norm
            self.own_norm = self.clip_whole(slots, self.other_norm)
            self.other_norm = None
            for optimizer in optimizers:
                optimizer.step()
            return result
        for slot, optimizer in zip(slots, optimizers):
            self.before_step(slot, optimizer)
            self.clip(slot)
            optimizer.step()
        return result

    def before_step(self, slot: str, optimizer: torch.optim.Optimizer) -> None:
        """What joins `slot`'s gradients before they are clipped and stepped on (a client's FedProx and
        SCAFFOLD terms); nothing here."""

    def gradients(self, slot: str) -> list[torch.Tensor]:
        return [p.grad for p in self.model(slot).parameters() if p.grad is not None]

    def backward_pass(self, *pairs: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """Back-propagate (tensor, gradient) pairs, gradient None for a loss (a pair whose tensor is
        None is left out): every backward pass of a step goes through here, where precision=fp16
        multiplies each seed by the role's loss scale."""
        scale = self.loss_scale
        if scale is not None:
            pairs = tuple(scale.seed(tensor, grad) for tensor, grad in pairs if tensor is not None)
            self._seeded = True
        defenses.backward(*pairs)

    @property
    def seed_scale(self) -> float:
        """What `backward_pass` multiplies its seeds by: the loss scale under fp16, else 1. A
        gradient a role computes outside it to seed it (FSL-SAGE's estimate of the cut gradient)
        is taken of its loss times this and divided by it in float32, so that fp16 keeps it."""
        return 1.0 if self.loss_scale is None else self.loss_scale.scale

    def incoming(self, message: Any) -> torch.Tensor | None:
        """A gradient received from another role (fp16: unscaled, float32); None when the sender
        skipped its step (fp16: scale 0, an overflow), and so this role's step is to be skipped
        (`skip`)."""
        return decode(message) if self.loss_scale is None else unscaled(message)

    def skip(self) -> None:
        """This step is not taken (a gradient it needed was skipped): under fp16 what it would
        send crosses as zeros with scale 0, and the scale stays (nothing was computed here)."""
        if self.loss_scale is not None:
            self.loss_scale.skip()

    def crossing(self, grads: list[torch.Tensor], fresh: bool = False) -> list[torch.Tensor]:
        """Gradients computed beside a step's check (under fp16 of a loss times `seed_scale`: SGLR's
        averages and CycleSL's ServerGrad, averaged in float32), as they will cross: in the cut's
        dtype and, under fp16, checked. If one of them is not finite (the scale then halves), or,
        unless `fresh` (a computation of its own, not the last step's), the role's last step was
        skipped, none crosses: `sent` gives zeros with scale 0, and the receivers skip."""
        dtype = self.blueprint.cut_dtype
        grads = grads if dtype is None else [g.to(dtype) for g in grads]
        if self.loss_scale is not None and (fresh or self.loss_scale.used):
            self.loss_scale.crossing(grads)
        return grads

    def sent(self, grad: torch.Tensor) -> Any:
        """A gradient as this role sends it (not through a defense): under fp16 scaled, with the
        scale it was computed under (zeros with scale 0 if that step was skipped)."""
        if self.loss_scale is None:
            return grad
        return scaled(outgoing(grad, self.loss_scale), self.loss_scale.used, grad.device)

    def unscale_for_step(self, slots: tuple[str, ...], sent: tuple[torch.Tensor, ...] = ()) -> bool:
        """Whether the step may go on: without fp16, always; with it, the gradients of `slots` are
        divided by the loss scale, and the step goes on if they and `sent` (scaled cut gradients)
        are finite (splitlab.loss_scale)."""
        if self.loss_scale is None:
            return True
        if not self._seeded:
            raise RuntimeError(f"{type(self).__name__}'s step back-propagated without Role.backward_pass, unscaled")
        self._seeded = False
        return self.loss_scale.unscale([g for slot in slots for g in self.gradients(slot)], sent)

    def clip(self, slot: str, norm: torch.Tensor | None = None) -> None:
        """`max_grad_norm=`: scale `slot`'s gradients to at most that total norm (`norm`, if known)."""
        most = self.blueprint.config.max_grad_norm
        if most is None:
            return
        grads = [p for p in self.model(slot).parameters() if p.grad is not None]
        if norm is None:
            torch.nn.utils.clip_grad_norm_(grads, most, foreach=True)
        else:
            torch.nn.utils.clip_grads_with_norm_(grads, most, norm, foreach=True)

    def clip_whole(self, slots: tuple[str, ...], other_norm: torch.Tensor) -> torch.Tensor:
        """clip_scope=global: scale the gradients of `slots` by the norm of the whole model the step
        trains, theirs and the other parts' (`other_norm`), to at most `max_grad_norm`; their own norm."""
        trained = [p for slot in slots for p in self.model(slot).parameters() if p.grad is not None]
        own = get_total_norm([g for slot in slots for g in self.gradients(slot)])
        whole = torch.linalg.vector_norm(torch.stack([own.float(), other_norm.float().to(own.device)]))
        most = cast(float, self.blueprint.config.max_grad_norm)
        torch.nn.utils.clip_grads_with_norm_(trained, most, whole, foreach=True)
        return own

    def micro_batches(
        self, x: torch.Tensor, y: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]]:
        """`grad_accum=`: a step's batch as micro-batches of `batch_size`, each (x, y, share),
        share its part of the targets the loss counts (a language task's: the tokens not IGNORED).
        The loss over the whole batch is the sum of share x each micro-batch's loss, exactly,
        whatever each counts; a batch of one micro-batch comes whole, share 1."""
        size = self.blueprint.config.batch_size
        if len(y) <= size:
            yield x, y, 1.0
            return
        counted = (y != IGNORED).sum()
        for xs, ys in zip(x.split(size), y.split(size)):
            yield xs, ys, (ys != IGNORED).sum() / counted

    def accumulate(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        objective: Callable[[torch.Tensor], torch.Tensor] = lambda value: value,
    ) -> torch.Tensor:
        """Back-propagate `objective` of the loss of `model` on a step's batch, micro-batch by
        micro-batch (`micro_batches`: each one's activations freed before the next); the loss."""
        total: torch.Tensor | None = None
        for xs, ys, share in self.micro_batches(x, y):
            value = self.blueprint.loss(model(xs), ys)
            if len(y) > len(ys):  # one of several micro-batches: its share of the step's loss
                value = value * share
            self.backward_pass((objective(value), None))
            total = value.detach() if total is None else total + value.detach()
        return cast(torch.Tensor, total)

    @verb()
    def end_round(self) -> None:
        """Give the working copies back to the pool."""
        for slot in list(self.scratch):
            self.return_copy(slot)

    @verb(up="evaluation")
    def snapshot(self, slot: str) -> State:
        """`slot`'s weights, for the engine to evaluate (the initial ones if never filled)."""
        module = self.models.get(slot)
        return shared_state(module) if module is not None else self.blueprint.initial_state(slot)

    @verb(up="checkpoint")
    def state_dict(self) -> State:
        own = [slot for slot in self.models if slot not in self.scratch]
        state: State = {
            "models": {slot: shared_state(self.models[slot]) for slot in own},
            "optimizers": {slot: self.optimizers[slot].state_dict() for slot in own if slot in self.optimizers},
        }
        if self.loss_scale is not None:
            state["loss_scale"] = self.loss_scale.state()
        return state

    @verb(down="checkpoint")
    def load_state_dict(self, state: State) -> None:
        if self.loss_scale is not None:
            self.loss_scale.load(state["loss_scale"])
        for slot, weights in state["models"].items():
            load_shared(self.model(slot), weights)
        for slot, optimizer_state in state["optimizers"].items():
            self.optimizers.pop(slot, None)
            self.optimizer(slot).load_state_dict(optimizer_state)


class ClientNode(Role[ParamsT]):
    """A client: its own samples and model slots, and the activations awaiting their cut gradient."""

    def __init__(
        self,
        blueprint: Blueprint,
        client_id: int,
        x: torch.Tensor,
        y: torch.Tensor,
        prepare: Callable[[torch.Tensor], torch.Tensor] | None = None,
        segments: torch.Tensor | None = None,
    ) -> None:
        super().__init__(blueprint)
        self.id, self.x, self.y = client_id, x, y
        #: packing=true: the segment ids of `x` (models/packed.py), and those of the batch being run
        self.segments = segments
        self.batch_segments: torch.Tensor | None = None
        #: stored samples -> model inputs, batch by batch (uint8 images stay uint8 until used)
        self.prepare = prepare
        #: the samples prepared, kept across rounds (`Blueprint.keep_prepared`); None until then
        self._prepared: torch.Tensor | None = None
        self.stash: dict[int, Any] = {}
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = iter(())
        self._releases = 0
        #: this round's client-part passes (the key of each one's `dchi` noise)
        self._embeddings = 0
        cfg = blueprint.config
        #: FedProx's and SCAFFOLD's terms of the averaged slots' objective; None without either
        self.local_terms = LocalTerms(cfg.prox_mu, cfg.scaffold) if cfg.prox_mu or cfg.scaffold else None
        #: secure_aggregation: this round's secrets of each averaged slot's protocol
        self._secure: dict[str, ClientSecrets] = {}
        #: keep_client_optimizer: by slot, the state of the optimizer of the copies it received, for the next one
        self.kept_optimizers: dict[str, State] = {}

    def drop_optimizer(self, slot: str) -> None:
        """keep_client_optimizer: the optimizer's state is kept for the next copy of `slot`."""
        optimizer = self.optimizers.pop(slot, None)
        if optimizer is not None and self.blueprint.config.keep_client_optimizer:
            self.kept_optimizers[slot] = optimizer.state_dict()

    def new_optimizer(self, slot: str) -> torch.optim.Optimizer:
        """keep_client_optimizer: with the state of the one the last copy of `slot` had."""
        optimizer = super().new_optimizer(slot)
        if slot in self.kept_optimizers:
            optimizer.load_state_dict(self.kept_optimizers[slot])
        return optimizer

    @property
    def num_samples(self) -> int:
        return self.y.shape[0]  # not len(): torch's Tensor.__len__ is Python, and this is asked at every batch

    def batches(self, rnd: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This round's mini-batches: `local_epochs` seeded passes over the local data, capped by
        `local_steps`, each augmented as configured (`augment=`) from its own keyed stream."""
        cfg, augment = self.blueprint.config, self.blueprint.augment
        steps = self.blueprint.steps_per_round(cfg, self.num_samples)
        # a round that draws every sample prepares them all at once, not batch by batch (the same
        # values: `prepare` works sample by sample), and keeps them for the next rounds if the
        # process's budget allows; otherwise its float copy lives for the round only
        whole = self._prepared
        drawn = steps * Blueprint.step_batch(cfg) >= self.num_samples
        if whole is None and not augment and self.prepare is not None and drawn:
            whole = self.prepare(self.x)
            if self.blueprint.keep_prepared(self, whole):
                self._prepared = whole

        def passes() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            for epoch in range(cfg.local_epochs):
                order = self.blueprint.rng(rnd, STREAM_BATCHES, self.id, epoch).permutation(self.num_samples)
                indices = torch.as_tensor(order, device=self.y.device).split(Blueprint.step_batch(cfg))
                for batch, idx in enumerate(indices):
                    self.batch_segments = None if self.segments is None else self.segments[idx]
                    if whole is not None:
                        yield whole[idx], self.y[idx]
                        continue
                    x = self.x[idx]
                    if augment:
                        x = augmented(augment, x, self.blueprint.rng(rnd, STREAM_AUGMENT, self.id, epoch, batch))
                    yield self.inputs(x), self.y[idx]

        return itertools.islice(passes(), steps)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.prepare is None else self.prepare(x)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.blueprint.on_batch is not None:
            self.blueprint.on_batch()
        return next(self._batches)

    @verb()
    def begin_round(self, rnd: int) -> None:
        super().begin_round(rnd)
        self.round_steps = self.blueprint.steps_per_round(self.blueprint.config, self.num_samples)
        self._batches = self.batches(rnd)
        self._releases = 0
        self._embeddings = 0
        if self.local_terms is not None:
            self.local_terms.new_round()
        self._secure = {}

    # --- secure aggregation of an averaged slot (splitlab.secure_aggregation) ---------------------
    @verb(up="secagg_keys_up")
    def secagg_keys(self, slot: str) -> torch.Tensor:
        """Phase 1: this round's two public keys for `slot`'s protocol."""
        self._secure[slot] = ClientSecrets(self.id)
        return self._secure[slot].keys()

    @verb(down="secagg_keys_down", up="secagg_shares_up")
    def secagg_shares(self, slot: str, public: State) -> State:
        """Phase 2: everyone's public keys in; the shares of this client's secrets out, each encrypted
        for its holder."""
        return self._secure[slot].shares(public)

    @verb(down="secagg_shares_down")
    def secagg_receive(self, slot: str, sealed: State) -> None:
        """Phase 2: the shares the others encrypted for this client."""
        self._secure[slot].receive(sealed)

    @verb(up="{0}_up")
    def upload_masked(self, slot: str, alpha: float) -> torch.Tensor:
        """Phase 3: `slot` times `alpha`, in fixed point, masked (the sync server cannot read it alone)."""
        return self._secure[slot].masked(flat(shared_state(self.model(slot))) * alpha)

    @verb(down="secagg_unmask_down", up="secagg_unmask_up")
    def secagg_unmask(self, slot: str, survivors: torch.Tensor, dropped: torch.Tensor) -> State:
        """Phase 4: the shares the server needs to unmask the sum of the survivors' inputs."""
        return self._secure[slot].unmask(survivors.tolist(), dropped.tolist())

    def before_step(self, slot: str, optimizer: torch.optim.Optimizer) -> None:
        """FedProx's mu (w - w_round) and SCAFFOLD's c - c_i join the gradients of an averaged slot."""
        if self.local_terms is not None and slot in self.blueprint.averaged:
            self.local_terms.before_step(slot, self.model(slot), optimizer.param_groups[0]["lr"])

    @verb(down="control_down")
    def load_control(self, slot: str, control: State) -> None:
        """SCAFFOLD: the server's control variate c of `slot` for this round's steps."""
        cast(LocalTerms, self.local_terms).server_controls[slot] = control

    @verb(up="control_up")
    def upload_control(self, slot: str) -> State:
        """SCAFFOLD, after the round's steps: Delta c_i of `slot` (option II); c_i is updated."""
        return cast(LocalTerms, self.local_terms).control_update(slot, self.model(slot))

    @verb(up="checkpoint")
    def state_dict(self) -> State:
        """The role's state; under SCAFFOLD with the client's control variates c_i (and, mid-round, as a
        client moves between Ray actors, this round's c)."""
        state = super().state_dict()
        if self.blueprint.config.scaffold:
            terms = cast(LocalTerms, self.local_terms)
            state["controls"] = {"own": dict(terms.controls), "server": dict(terms.server_controls)}
        if self.blueprint.config.keep_client_optimizer:
            state["kept_optimizers"] = dict(self.kept_optimizers)
        return state

    @verb(down="checkpoint")
    def load_state_dict(self, state: State) -> None:
        super().load_state_dict(state)
        if self.blueprint.config.scaffold:
            terms = cast(LocalTerms, self.local_terms)
            terms.controls, terms.server_controls = dict(state["controls"]["own"]), dict(state["controls"]["server"])
        if self.blueprint.config.keep_client_optimizer:
            self.kept_optimizers = dict(state["kept_optimizers"])

    def release(
        self, x: torch.Tensor, y: torch.Tensor, smashed: torch.Tensor, step: int | None = None
    ) -> tuple[torch.Tensor, State]:
        """Smashed data on its way out, with the client's defenses (splitlab.privacy.defenses)
        applied: the defended tensor (which the cut gradient will reach) and the message for the
        server, compressed as configured. Without a defense: `smashed` and its detached self."""
        defense = self.blueprint.defense
        if self.blueprint.cut_dtype is not None:
            smashed = smashed.to(self.blueprint.cut_dtype)
        defended = defense.protect(smashed, self._noise_generator(smashed.device))
        wire = defense.encode(defended)
        if self.blueprint.recorder is not None:  # a release without a step awaits no gradient: a key no step has
            key = -1 - self._releases if step is None else step
            weights = lambda: shared_state(self.model("client_model"))  # noqa: E731  # what made the record
            self.blueprint.recorder.sent(self.id, key, x, decode(wire), y, weights)
        self._releases += 1
        message = {"smashed": wire, "labels": self._labels_out(y)}
        if self.batch_segments is not None:  # packing=true: the server part keeps to the batch's rows too
            message["segments"] = self.batch_segments
        return defended, message

    def client_output(self, x: torch.Tensor) -> torch.Tensor:
        """The client part on `x`, with `dchi` noise on the token embeddings from a stream keyed by
        this client's secret, the round and the pass (splitlab.privacy.keys)."""
        defense, generator = self.blueprint.defense, None
        if defense.dchi is not None:
            generator = keys.generator(
                self.blueprint.noise_secret,
                f"client {self.id} embeddings",
                self.round,
                self._embeddings,
                device=x.device,
            )
        self._embeddings += 1
        with packed.rows(self.batch_segments):
            return defense.client_output(self.model("client_model"), x, generator)

    def _labels_out(self, y: torch.Tensor) -> torch.Tensor:
        """The labels as they leave: with `label_dp`, randomised response from a stream keyed by
        this client's secret, the round and the release (as the smashed data's noise)."""
        defense = self.blueprint.defense
        if defense.label_dp is None:
            return y
        generator = keys.generator(
            self.blueprint.noise_secret, f"client {self.id} labels", self.round, self._releases, device=y.device
        )
        return defense.private_labels(y, self.blueprint.num_classes, generator)

    def _noise_generator(self, device: torch.device) -> torch.Generator | None:
        """The release's own noise stream, keyed by this client's secret, the round and the
        release (splitlab.privacy.keys): unpredictable to the server, and resumable."""
        if self.blueprint.defense.noise == 0:
            return None
        return keys.generator(
            self.blueprint.noise_secret, f"client {self.id}", self.round, self._releases, device=device
        )

    def receive(self, step: int, cut_grad: Any) -> torch.Tensor | None:
        """The cut gradient of `step` from its wire form (fp16: unscaled, float32); None when the
        server skipped the step (fp16: its backward pass overflowed), and so does the client."""
        grad = decode(cut_grad) if self.loss_scale is None else unscaled(cut_grad)
        if grad is None:
            return None
        if self.blueprint.recorder is not None:
            self.blueprint.recorder.received(self.id, step, grad)
        return grad

    @verb(down="{0}_down")
    def load(self, slot: str, state: State) -> None:
        """Receive a model into `slot` (a working copy with a fresh optimizer)."""
        self.load_copy(slot, state)

    @verb(down="kept_state_down")
    def rejoin(self, state: State) -> None:
        """Back after dropping out, as a fresh node: its kept slots and their optimizers as the
        server last checkpointed them (`state_dict`), so it trains on where it was."""
        self.load_state_dict(state)

    @verb(up="{0}_up")
    def upload(self, slot: str) -> State:
        return shared_state(self.model(slot))

    @verb(up=KEYED, keys=SENT)
    def forward(self, step: int) -> State:
        """Client part on the next batch; the activations wait (by step) for their gradient."""
        x, y = self.next_batch()
        with self.blueprint.timed("client"):
            smashed = self.client_output(x)
            defended, message = self.release(x, y, smashed, step)
            self.stash[step] = defended, self.blueprint.defense.penalty(x, smashed)
        return message

    @verb(down="cut_grad")
    def backward(self, step: int, cut_grad: Any) -> None:
        """Back-propagate the cut gradient of `step` (one vector is broadcast over the batch) and
        NoPeek's penalty, if any, and step."""
        defended, penalty = self.stash.pop(step)
        grad = self.receive(step, cut_grad)
        if grad is None:
            return
        with self.blueprint.timed("client"):
            self.step(
                "client_model",
                functools.partial(self.backpropagate, step, (defended, grad.expand_as(defended)), (penalty, None)),
            )

    @verb(down=(None, "cut_grad", "grad_norm_down"), up=KEYED, keys=("grad_norm_up",))
    def backward_whole(self, step: int, cut_grad: Any, server_norm: torch.Tensor) -> State:
        """clip_scope=global: `backward`, the client part's gradients clipped by the norm of the whole
        model (theirs and the server part's, `server_norm`); their own norm goes up, for the server's."""
        self.other_norm = server_norm
        self.backward(step, cut_grad)
        own, self.own_norm, self.other_norm = self.own_norm, None, None
        return {"grad_norm_up": cast(torch.Tensor, own).float()}

    def backpropagate(self, step: int, *pairs: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
        """The client part's gradients for `step`: of each (tensor, its gradient) pair (a U-shaped
        client adds its tail's: splitlab.u_shaped)."""
        self.backward_pass(*pairs)

    @verb(up=KEYED, keys=("loss",))
    def local_step(self) -> State:
        """One ordinary step of the whole model in `client_model` on the next batch (FedAvg)."""
        x, y = self.next_batch()
        with self.blueprint.timed("client"):
            value = self.step("client_model", lambda: self.accumulate(self.model("client_model"), x, y))
        return {"loss": value}

    @verb()
    def end_round(self) -> None:
        if self.stash:
            raise RuntimeError(f"client {self.id} ends the round with steps {sorted(self.stash)} awaiting gradients")
        self._batches = iter(())  # with them, the round's prepared samples (unless kept)
        super().end_round()


class TrainingServer(Role[ParamsT]):
    """The server part (slot `server_model`), trained on the smashed data clients send."""

    #: whether each step's figures (`step`) are checked before its optimizer steps, as where one
    #: client's data can be to blame (over a network, on Ray); False in process, where a non-finite
    #: step means training diverged: the figures stay on the device, checked at `end_round`
    checks_each_step = True

    def __init__(self, blueprint: Blueprint) -> None:
        super().__init__(blueprint)
        self._unchecked: list[torch.Tensor] = []
        self._average: ModelAverage | None = None
        #: clip_scope=global: by slot, the norm of a step's gradients held until the client's comes (`finish_step`)
        self._held: dict[str, torch.Tensor] = {}
        self._last_norm: torch.Tensor | None = None  # log_every: that of the last step

    @verb()
    def begin_round(self, rnd: int, steps: dict[str, int] | None = None) -> None:
        """Round `rnd` begins, in which the algorithm has this server take `steps[slot]` optimizer
        steps of each slot (their place in a per-step schedule)."""
        super().begin_round(rnd)
        self.slot_steps = steps or {}

    def objective(self, value: torch.Tensor) -> torch.Tensor:
        """What the server minimises given the batch loss (SplitGP scales it)."""
        weight = self.cut_gradient_weight(self.params)
        return value if weight == 1 else weight * value

    @staticmethod
    def cut_gradient_weight(params: Any) -> float:
        """The weight of the batch loss in the server's objective, and so in the cut gradients it
        sends (0: they carry nothing; label_leak refuses such a run)."""
        return 1.0

    def step(
        self,
        slot: str,
        backward: Callable[[], Any],
        inputs: tuple[torch.Tensor, ...] = (),
        value: torch.Tensor | None = None,
    ) -> Any:
        """One optimizer step of `slot`, taken only if the loss `value`, the norm of its gradients
        and that of `inputs`' (the smashed data: the cut gradient) are finite; else NonFiniteStep,
        and the model and its optimizer are untouched (a client's extreme data cannot corrupt them:
        a norm that overflows would overflow Adam's moments or any clipping too). The gradients
        are clipped (`max_grad_norm`) with the norm checked. One sync; none unless
        `checks_each_step` (the round's figures are checked at its end, and a run whose were not
        finite stops as diverged). What `backward` returns (the loss, if `value` is None)."""
        optimizer = self.optimizer(slot)
        self.steps_taken[slot] += 1
        optimizer.zero_grad(set_to_none=True)
        result = backward()
        if value is None and isinstance(result, torch.Tensor):
            value = result
        cut_grads = [z.grad for z in inputs if z.grad is not None]
        taken = self.unscale_for_step((slot,), tuple(cut_grads))
        grads = self.gradients(slot) if taken else []  # fp16: an overflow skips the step, its loss still checked
        unscale = self.loss_scale.used if self.loss_scale is not None and taken else 1.0
        figures = {  # STEP_FIGURES
            "loss": torch.zeros(()) if value is None else value.detach(),
            "gradient norm": get_total_norm(grads),
            "cut-layer gradient norm": get_total_norm([g.float() for g in cut_grads] if taken else []) / unscale,
        }
        self._last_norm = figures["gradient norm"]
        device = figures["gradient norm"].device
        stacked = torch.stack([f.float().to(device) for f in figures.values()])
        if self.checks_each_step:
            try:
                self._check_finite(stacked[None])
            except NonFiniteStep:
                optimizer.zero_grad(set_to_none=True)
                raise
        else:
            self._unchecked.append(stacked)
        if not taken:
            optimizer.zero_grad(set_to_none=True)
            return result
        if self.blueprint.config.clip_scope == "global":  # the step waits for the client part's norm
            self._held[slot] = figures["gradient norm"]
            return result
        self.clip(slot, figures["gradient norm"])
        optimizer.step()
        return result

    def held_norm(self, slot: str) -> State:
        """The norm of `slot`'s last step (`grad_norm`), for the reply: with clip_scope=global, held for
        the client's; with log_every, for the log (else nothing, and replies are as they were)."""
        if slot in self._held:
            return {"grad_norm": self._held[slot]}
        return {"grad_norm": self._last_norm} if self.blueprint.config.log_every and self._last_norm is not None else {}

    @verb()
    def finish_step(self, slot: str, client_norm: torch.Tensor | None) -> None:
        """clip_scope=global: take `slot`'s held step, its gradients clipped by the norm of the whole
        model (its own and the client part's, `client_norm`); None (the client dropped out): drop it."""
        norm, optimizer = self._held.pop(slot), self.optimizers[slot]  # (its rate as set when the step began)
        if client_norm is not None:
            whole = torch.linalg.vector_norm(torch.stack([norm.float(), client_norm.float().to(norm.device)]))
            self.clip(slot, whole)
            optimizer.step()
        else:
            optimizer.zero_grad(set_to_none=True)

    @verb()
    def train_step(
        self, smashed: Any, labels: torch.Tensor, slot: str = "server_model", segments: torch.Tensor | None = None
    ) -> State:
        """One server step on received smashed data (packing=true: with the batch's `segments`);
        returns the cut gradient (compressed as configured) and the loss."""
        smashed = decode(smashed).requires_grad_()
        reply = self.learn(smashed, labels, slot, segments)
        return {
            "cut_grad": self.send_gradient(cast(torch.Tensor, smashed.grad), labels),
            **reply,
            **self.held_norm(slot),
        }

    def send_gradient(self, grad: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        """A cut gradient as sent down: `gradnoise` and `marvell` (which needs the batch's `labels`)
        from a stream keyed by the server's secret and the gradient itself (splitlab.privacy.keys),
        then compressed as configured."""
        defense = self.blueprint.defense
        if self.loss_scale is not None:  # fp16: scaled as computed, with its scale; zeros if the step was skipped
            return scaled(defense.encode(outgoing(grad, self.loss_scale)), self.loss_scale.used, grad.device)
        generator = None
        if defense.noises_gradients:
            generator = keys.generator(
                self.blueprint.noise_secret, "server", keys.content_counter(grad), device=grad.device
            )
        return defense.send_gradient(grad, generator, labels)

    @verb()
    def learn(
        self, smashed: Any, labels: torch.Tensor, slot: str = "server_model", segments: torch.Tensor | None = None
    ) -> State:
        """One server step on received smashed data (packing=true: run within the batch's rows,
        `segments`); nothing goes back but the loss."""
        smashed = decode(smashed)
        model = self.model(slot)
        inputs = (smashed,) if smashed.requires_grad else ()
        with self.blueprint.timed("server"), packed.rows(segments):
            value = self.step(slot, lambda: self.accumulate(model, smashed, labels, self.objective), inputs)
        return {"loss": value}

    @verb()
    def learn_from(self, client_id: int, smashed: torch.Tensor, labels: torch.Tensor) -> State:
        """A server step on what a client sent unasked (federated split learning with aux models)."""
        return self.learn(smashed, labels)

    # --- per-client copies of the server part (SplitFed v1, PSL, SplitGP) ----------------
    @verb()
    def copy_server(self, client_id: int) -> None:
        """Start client `client_id`'s working copy `server_copy(client_id)` of the server part, with a
        fresh optimizer (clients training at once each have their own)."""
        self.load_copy(server_copy(client_id), shared_state(self.model("server_model")))

    @verb()
    def fold_copy(self, client_id: int, alpha: float) -> None:
        """Add the client's working copy, weighted alpha, to the average of this round's copies; the
        copy goes back to the pool."""
        self.fold_state(shared_state(self.models[server_copy(client_id)]), alpha)
        self.return_copy(server_copy(client_id))

    @verb()
    def fold_state(self, state: State, alpha: float) -> None:
        """Add the weights of a server part, weighted alpha, to the average of this round's copies
        (vectorize=true: a cohort's copies, trained together, already averaged among themselves)."""
        self._average = self._average or ModelAverage()
        self._average.add(state, alpha)

    @verb()
    def drop_copy(self, client_id: int) -> None:
        """Client `client_id` dropped out: its working copy goes back to the pool unused, and the
        average of the round's copies is renormalised over the copies of those that finished."""
        self._average = self._average or ModelAverage()
        self._average.incomplete = True
        if server_copy(client_id) in self.models:
            self.return_copy(server_copy(client_id))

    @verb()
    def average_copies(self) -> None:
        """The server part becomes the average of the round's copies (no traffic: one server); if
        every client dropped out, it stays as it was."""
        if self._average is not None and not self._average.empty:
            server = self.model("server_model")
            load_shared(server, self._average.result(shared_state(server)))
        self._average = None

    def _check_finite(self, steps: torch.Tensor) -> None:
        """NonFiniteStep for the first of `steps` (rows of `step`'s figures) with a figure not finite. One sync."""
        for row in steps.tolist():
            for what, figure in zip(STEP_FIGURES, row):
                if not math.isfinite(figure):
                    raise NonFiniteStep(what, figure)

    @verb()
    def end_round(self) -> None:
        """Give the working copies back; the round's step figures, if not checked at each step, are checked now."""
        super().end_round()
        self._held.clear()  # a step whose client dropped out before its norm came
        if self._unchecked:
            steps, self._unchecked = torch.stack(self._unchecked), []
            self._check_finite(steps)


class SyncServer(Role[ParamsT]):
    """The global models clients start from (slot names as the clients'), and their averages."""

    def __init__(self, blueprint: Blueprint) -> None:
        super().__init__(blueprint)
        self._averages: dict[str, ModelAverage] = {}
        self.loss_scale = None  # it trains nothing
        cfg = blueprint.config
        #: FedOpt (splitlab.strategies); None: server_opt=avg at server_opt_lr=1, the mean as it is
        self.server_optimizer = (
            None
            if cfg.server_opt == "avg" and cfg.server_opt_lr == 1
            else ServerOptimizer(
                cfg.server_opt,
                cfg.server_opt_lr,
                cfg.server_opt_momentum,
                (cfg.server_opt_betas[0], cfg.server_opt_betas[1]),
                cfg.server_opt_tau,
            )
        )
        #: SCAFFOLD: the control variate c of each averaged slot, and this round's 1/N sum_i Delta c_i
        self.controls: dict[str, State] = {}
        self._control_sums: dict[str, State] = {}
        #: secure_aggregation: this round's masked sum of each slot (splitlab.secure_aggregation)
        self._masked: dict[str, MaskedSum] = {}

    @verb()
    def model_state(self, slot: str) -> State:
        return shared_state(self.model(slot))

    @verb()
    def add(self, slot: str, state: State, alpha: float) -> None:
        self._averages.setdefault(slot, ModelAverage()).add(state, alpha)

    @verb()
    def missing(self, slot: str) -> None:
        """A client that dropped out will not add its `slot`: the average is renormalised over the
        weights of those that did (nobody did: the global model stays as it was)."""
        self._averages.setdefault(slot, ModelAverage()).incomplete = True

    @verb()
    def average(self, slot: str) -> None:
        """`slot` becomes the average of what was added since the last call (with server_opt, the
        server optimizer's step from it); under SCAFFOLD, c moves by what was added to it."""
        model, average = self.model(slot), self._averages.pop(slot)
        added = self._control_sums.pop(slot, None)
        if added is not None:
            self.controls[slot] = {name: c + added[name] for name, c in self.control(slot).items()}
        if average.incomplete and average.empty:
            return
        mean = average.result(shared_state(model))
        if self.server_optimizer is not None:
            mean = self.server_optimizer.step(slot, shared_state(model), mean)
        load_shared(model, mean)

    @verb()
    def secagg_begin(self, slot: str, public: State, holders: int) -> None:
        """Secure aggregation of `slot` starts: the public keys of those who shared their secrets
        (the round's `holders` clients advertised keys)."""
        self._masked[slot] = MaskedSum(public, holders)

    @verb()
    def secagg_graph(self, slot: str, neighbours: State) -> None:
        """secagg_neighbours (SecAgg+): the neighbours each client of `slot`'s protocol shared its secrets
        with and masked with, instead of every other client."""
        self._masked[slot].neighbours = {int(v): set(near.tolist()) for v, near in neighbours.items()}

    @verb()
    def add_masked(self, slot: str, client_id: int, masked: torch.Tensor, alpha: float) -> None:
        self._masked[slot].add(client_id, masked, alpha)

    @verb()
    def secagg_outcome(self, slot: str) -> State:
        """Who sent a masked input of `slot` and who did not: what the unmasking asks shares for."""
        masked = self._masked[slot]
        return {"survivors": torch.tensor(sorted(masked.sent)), "dropped": torch.tensor(masked.dropped())}

    @verb()
    def unmask(self, slot: str, answers: dict[int, State]) -> None:
        """The survivors' sum from the clients' shares: what `average` takes as the round's (renormalised
        over the survivors' weights if some dropped before masking, also before sharing their secrets:
        `missing`)."""
        masked, average = self._masked.pop(slot), self._averages.pop(slot, ModelAverage())
        average.incomplete = average.incomplete or bool(masked.dropped())
        if masked.sent:  # else every client dropped: the global model stays
            total = unflat(masked.unmasked(answers), shared_state(self.model(slot)))
            weight = sum(masked.sent.values())
            average.add({name: t / weight for name, t in total.items()}, weight)
        self._averages[slot] = average

    @verb()
    def control(self, slot: str) -> State:
        """SCAFFOLD's c of `slot` (zeros before its first round)."""
        if slot not in self.controls:
            self.controls[slot] = zeros_like(trainable(self.model(slot)))
        return self.controls[slot]

    @verb()
    def add_control(self, slot: str, delta: State, weight: float) -> None:
        """A client's Delta c_i of `slot`, weighted 1/N, into this round's sum."""
        total = self._control_sums.get(slot)
        if total is None:
            self._control_sums[slot] = {name: d.float() * weight for name, d in delta.items()}
        else:
            for name, d in delta.items():
                total[name].add_(d.float(), alpha=weight)

    @verb(up="checkpoint")
    def state_dict(self) -> State:
        """The global models; with server_opt its state, under SCAFFOLD the control variates."""
        state = super().state_dict()
        if self.server_optimizer is not None:
            state["server_optimizer"] = self.server_optimizer.state_dict()
        if self.blueprint.config.scaffold:
            state["controls"] = dict(self.controls)
        return state

    @verb(down="checkpoint")
    def load_state_dict(self, state: State) -> None:
        super().load_state_dict(state)
        if self.server_optimizer is not None:
            self.server_optimizer.load_state_dict(state["server_optimizer"])
        if self.blueprint.config.scaffold:
            self.controls = dict(state["controls"])
