"""The round loop every algorithm shares: sampling, evaluation, logging, checkpoints and resume.

`run(config)` validates everything and builds the whole experiment (roles, transport, algorithm)
before it writes a byte, so a bad setting never leaves a half-made run directory. Every random
choice is drawn from a stream keyed by (seed, round, purpose), and a checkpoint holds every
role's state that outlives a round, so a killed run resumed from its last checkpoint replays the
rounds since and ends bit for bit where an uninterrupted one would. Checkpoints are encoded in the
loop (a snapshot) and written to disk in the background, every `checkpoint_every` seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from splitlab import codec, rundir
from splitlab.algorithms import get_algorithm
from splitlab.algorithms.base import Algorithm, ClientInfo, Context
from splitlab.augment import check_augment
from splitlab.callbacks import Callback, CommBudget, MetricsFile, ProgressBar, RecorderFlush
from splitlab.config import (
    RUN_CONTROL_KEYS,
    ResolvedConfig,
    RunConfig,
    parse_test_split,
    parse_train_range,
)
from splitlab.data import Dataset, counts_report, load_dataset, load_split, partition, partition_report
from splitlab.data.datasets import data_summary
from splitlab.errors import NonFiniteLoss, NonFiniteStep, RoleLost, RoundFailed, UserError
from splitlab.io import (
    save_safetensors,
    write_json,
    write_safetensors,
    write_yaml,
)
from splitlab.ledger import Ledger
from splitlab.loggers import check_logger, make_logger
from splitlab.logs import LOGGER
from splitlab.metrics import TASK_METRICS, logits_in_batches
from splitlab.models import HeadAndTail, joined, load_shared, split
from splitlab.privacy import keys
from splitlab.privacy.accounting import privacy_summary
from splitlab.privacy.record import Recorder
from splitlab.process import prepare_process, training_device
from splitlab.resolve import resolve_config
from splitlab.roles import Blueprint, ClientNode, State, SyncServer, TrainingServer, random_stream
from splitlab.runfiles import CHECKPOINT, RUN_FILES
from splitlab.streams import register_stream
from splitlab.transport import TRANSPORTS, ClientDropped, Transport
from splitlab.units import GIB, to_target

STREAM_SAMPLING = register_stream("sampling", 0)


@dataclasses.dataclass
class Roles:
    """The role objects themselves: the engine's (deployment's) to build and hold, never an algorithm's."""

    clients: list[ClientNode]
    server: TrainingServer
    sync: SyncServer


@dataclasses.dataclass
class Experiment:
    """A fully built run, nothing written yet."""

    config: ResolvedConfig
    data: Dataset  # the test split (the training samples live in the client nodes)
    clients: list[ClientInfo]
    algorithm: Algorithm
    partition_report: dict
    roles: Roles | None  # None: the roles live in other processes (backend=ray)
    blueprint: Blueprint
    transport: Transport
    #: test_split=client: each client's held-out (x, y)
    client_test: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    _assembler: Assembler | None = None

    @property
    def out(self) -> Path:
        return self.config.out_dir

    @property
    def ledger(self) -> Ledger:
        return self.transport.ledger

    @property
    def assembler(self) -> Assembler:
        if self._assembler is None:
            self._assembler = Assembler(self.blueprint)
        return self._assembler

    def assemble(self, states: list[State]) -> nn.Module:
        return self.assembler(states)

    def full_state(self, states: list[State]) -> dict[str, torch.Tensor]:
        return self.assembler.full_state(states)


class Assembler:
    """The evaluated model from role states (the whole model, or client part then server part),
    loaded into modules made once."""

    def __init__(self, blueprint: Blueprint) -> None:
        self.blueprint = blueprint
        self._parts: list[nn.Module] = []

    def _made(self, count: int) -> list[nn.Module]:
        """The whole model (count 1), or client part then server part (count 2)."""
        if len(self._parts) != count:
            model = self.blueprint.new_model()
            cuts = self.blueprint.config.cut, self.blueprint.config.tail_cut
            self._parts = [model] if count == 1 else list(split(model, *cuts))
            for part in self._parts:
                part.eval()
        return self._parts

    def __call__(self, states: list[State]) -> nn.Module:
        for part, state in zip(self._made(len(states)), states):
            load_shared(part, state)
        return joined(self._parts)

    def server_state(self, state: State) -> dict[str, torch.Tensor]:
        """The server part's whole state (a frozen base included) from what its role holds."""
        server = self._made(2)[1]
        load_shared(server, state)
        return dict(server.state_dict())

    @property
    def parts(self) -> list[nn.Module]:
        """The modules last assembled: the whole model, or client part then server part."""
        return self._parts

    def full_state(self, states: list[State]) -> dict[str, torch.Tensor]:
        """The whole model of role states under the unsplit model's names, a frozen base included."""
        self(states)
        return {name: t for part in self._parts for name, t in part.state_dict().items()}


def test_set(config: ResolvedConfig, data: Dataset, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples every evaluation uses, prepared once: the test split, or its seeded `test_subset`."""
    run = config.run
    test = _seeded_subset(len(data.test_y), run.test_subset, run.seed, "test_subset")
    return data.inputs(data.test_x[test].to(device)), data.test_y[test].to(device)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    elif name == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is available; use device=cpu or auto")
    return training_device(torch.device(name))


def _seeded_subset(size: int, subset: int | None, seed: int, what: str) -> np.ndarray:
    """Sorted indices of a seeded choice of `subset` out of `size` samples (all if None)."""
    if subset is None:
        return np.arange(size)
    if subset > size:
        raise UserError(f"{what}={subset} is more than the {size} samples the dataset has")
    return np.sort(np.random.default_rng([seed, size]).choice(size, subset, replace=False))


def _client_indices(config: ResolvedConfig, data: Dataset) -> list[np.ndarray]:
    run = config.run
    if run.clients == "all":
        if data.train_groups is None:
            raise UserError(f"clients=all needs a dataset with natural users; {run.dataset!r} has none")
        return [np.sort(group) for group in data.train_groups]
    # With natural users, only their samples are drawn (Shakespeare's windows straddling two roles
    # belong to nobody); otherwise all of them.
    users = np.arange(len(data.train_y)) if data.train_groups is None else np.sort(np.concatenate(data.train_groups))
    if run.train_range is not None:  # a stretch in the dataset's order (shakespeare_lm: play by play)
        start, stop = parse_train_range(run.train_range)
        users = users[round(start * len(users)) : round(stop * len(users))]
        if len(users) == 0:
            raise UserError(f"train_range={run.train_range} holds none of the {len(data.train_y)} training samples")
    pool = users[_seeded_subset(len(users), run.train_subset, run.seed, "train_subset")]
    parts = partition(data.train_labels.numpy()[pool], run.clients, run.partition, run.seed)
    return [pool[part] for part in parts]


def _hold_out(indices: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Sample-wise train/test split of every client (as LEAF's `split_data.py --by_sample`): a seeded
    choice of n - max(1, int((1 - fraction) * n)) of its samples is held out, at least one kept."""
    train, test = [], []
    for k, idx in enumerate(indices):
        n_test = len(idx) - max(1, int((1 - fraction) * len(idx)))
        held = np.zeros(len(idx), dtype=bool)
        held[np.random.default_rng([seed, k, len(idx)]).choice(len(idx), n_test, replace=False)] = True
        train.append(idx[~held])
        test.append(idx[held])
    return train, test


def make_blueprint(config: ResolvedConfig, data: Dataset, device: torch.device) -> Blueprint:
    """The run's blueprint, the same in every process that builds roles for it."""
    check_augment(config.run.augment, data.name, data.input_shape, data.task)
    return blueprint_of(
        config, device, data.input_shape, data.num_classes, data.inputs(data.train_x[:1]).dtype, data.task
    )


def blueprint_of(
    config: ResolvedConfig,
    device: torch.device,
    input_shape: tuple[int, ...],
    num_classes: int,
    input_dtype: torch.dtype,
    task: str,
) -> Blueprint:
    """The run's blueprint from what it needs of the data: a role that holds no samples (the
    training server on Ray) gets these from the driver and never loads the dataset."""
    run = config.run
    return Blueprint(
        run,
        config.params,
        device,
        input_shape,
        num_classes,
        input_dtype,
        task,
        builders=get_algorithm(run.algorithm).models,
        recorder=Recorder(run.record) if run.record else None,
    )


def client_nodes(blueprint: Blueprint, data: Dataset, owners: Mapping[int, np.ndarray]) -> list[ClientNode]:
    """A node per data owner k holding only its samples `owners[k]`, as stored (uint8 images are
    prepared batch by batch)."""
    Client = get_algorithm(blueprint.config.algorithm).Client
    device = blueprint.device
    return [
        Client(blueprint, k, data.train_x[idx].to(device), data.train_y[idx].to(device), data.prepare)
        for k, idx in owners.items()
    ]


@dataclasses.dataclass
class _Plan:
    """What the server and every client node derive alike from the config: data, partition, blueprint."""

    config: ResolvedConfig
    data: Dataset
    owners: list[np.ndarray] | None  # the samples of each client node; None: the clients' own (data=own)
    client_test: list[tuple[torch.Tensor, torch.Tensor]] | None
    partition_report: dict | None  # data=own: from the clients' reports
    algorithm_class: type[Algorithm]
    blueprint: Blueprint
    held_out: list[np.ndarray] | None = None  # test_split=client: the samples each client holds out

    @property
    def client_count(self) -> int:
        return len(self.owners) if self.owners is not None else int(self.config.run.clients)

    def node(self, client_id: int) -> ClientNode:
        """Client node `client_id`, holding only its own samples."""
        assert self.owners is not None, "data=own: the client nodes hold their own samples, elsewhere"
        return client_nodes(self.blueprint, self.data, {client_id: self.owners[client_id]})[0]

    def class_counts(self) -> list[list[int]] | None:
        """How many samples of each class every client node holds (None: data=own, the clients say)."""
        if self.owners is None:
            return None
        labels = self.data.train_labels.numpy()
        return [np.bincount(labels[idx], minlength=self.blueprint.num_classes).tolist() for idx in self.owners]

    def data_summaries(self) -> list[dict[str, Any]] | None:
        """What identifies every client node's samples (`data_summary`; None: data=own)."""
        if self.owners is None:
            return None
        data = self.data
        return [data_summary(data.train_y[idx], data.task, data.num_classes) for idx in self.owners]


def _plan(config: ResolvedConfig) -> _Plan:
    run = config.run
    if run.setting == "vertical":  # built by splitlab.vertical, in one process
        from splitlab.vertical import refuse_elsewhere

        refuse_elsewhere(run)
    device = resolve_device(run.device)
    if run.data == "own":
        return _own_data_plan(config, device)
    data = load_data(run)
    _check_task(config, data)
    indices = _client_indices(config, data)
    held_out = parse_test_split(run.test_split)
    client_test, held = None, None
    if held_out is not None:
        indices, held = _hold_out(indices, held_out, run.seed)  # prepared once, for every evaluation
        client_test = [(data.inputs(data.train_x[idx].to(device)), data.train_y[idx].to(device)) for idx in held]
    report = partition_report(data.train_labels.numpy(), indices, data.num_classes)
    algorithm_class = get_algorithm(run.algorithm)
    blueprint = make_blueprint(config, data, device)
    _check_cut(blueprint, algorithm_class)
    owners = algorithm_class.data_owners(indices)
    return _Plan(config, data, owners, client_test, report, algorithm_class, blueprint, held)


def load_data(run: RunConfig) -> Dataset:
    """The run's dataset (a language dataset at its `seq_len`, tokenised by `model_dir`'s tokenizer if any)."""
    return load_dataset(run.dataset, run.data_dir, seed=run.seed, seq_len=run.seq_len, tokenizer_dir=run.model_dir)


def _check_cut(blueprint: Blueprint, algorithm_class: type[Algorithm]) -> None:
    """A cut outside the model's range, or one whose server part has nothing to train (a frozen
    base whose adapters are all on the client side), fails here."""
    cut = blueprint.config.cut
    blueprint.new_model().client_stage_count(cut)
    blueprint.new_split()  # a U-shaped split's second cut
    if "server_model" in algorithm_class.models and not any(
        p.requires_grad for p in blueprint.new_split()[1].parameters()
    ):
        raise UserError(
            f"cut={cut} leaves the server part nothing to train (lora freezes all but its adapters); "
            f"choose a lower cut, or lora_targets that reach the server's layers"
        )


def _check_task(config: ResolvedConfig, data: Dataset) -> None:
    """Refuse what a dataset's task does not allow: a class-based partition of sequences, or an
    algorithm whose design assumes the other task."""
    run, algorithm = config.run, get_algorithm(config.run.algorithm)
    if data.task in algorithm.refused_tasks:
        raise UserError(
            f"algorithm={run.algorithm} cannot run dataset={run.dataset}: {algorithm.refused_tasks[data.task]}"
        )
    if data.task == "language" and run.partition != "iid":
        raise UserError(
            f"partition={run.partition} splits by class; {run.dataset}'s sequences have none: use iid or clients=all"
        )
    if data.task == "language" and "dp:" in run.defense:
        raise UserError(
            f"defense={run.defense}: no epsilon holds for {run.dataset}, whose targets (the text shifted by one "
            f"token) reach the server in the clear; clip, noise and nopeek still apply, without a guarantee"
        )


def _own_data_plan(config: ResolvedConfig, device: torch.device) -> _Plan:
    """A server whose clients bring their own samples (data=own): it reads the test set alone, and
    learns what each client holds from its report (splitlab.net)."""
    run = config.run
    refusals = {
        "clients": (run.clients == "all", "data=own needs clients=K, the number of clients that will report"),
        "partition": (run.partition != "iid", "data=own: each client's samples are its own, not a partition's"),
        "train_subset": (run.train_subset is not None, "data=own: each client uses every sample in its data_dir"),
        "train_range": (run.train_range is not None, "data=own: each client uses every sample in its data_dir"),
        "test_split": (run.test_split != "global", "data=own: the server evaluates on the dataset's test set"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise UserError(f"{key}={getattr(run, key)} cannot be used with data=own; {why}")
    algorithm_class = get_algorithm(run.algorithm)
    if len(algorithm_class.data_owners([np.arange(0)] * int(run.clients))) != run.clients:
        raise UserError(f"algorithm={run.algorithm} pools the clients' samples in one node; data=own keeps them apart")
    data = load_split(run.dataset, "test", run.data_dir)
    blueprint = make_blueprint(config, data, device)
    _check_cut(blueprint, algorithm_class)
    return _Plan(config, data, None, None, None, algorithm_class, blueprint)


def client_node(raw: Mapping[str, Any], client_id: int) -> ClientNode:
    """Client node `client_id` of the run `raw` configures, built in this process (a networked
    client): the same samples, batches and initial weights as the node `build` would make. With
    data=own, its samples are every training sample in `data_dir` (the client's own)."""
    config = resolve_config(raw)
    run = config.run
    if run.data == "own":
        if run.clients != "all" and not 0 <= client_id < run.clients:
            raise UserError(f"client_id={client_id} is not a client of this run; allowed: 0 to {run.clients - 1}")
        data = load_split(run.dataset, "train", run.data_dir)
        blueprint = make_blueprint(config, data, resolve_device(run.device))
        return client_nodes(blueprint, data, {client_id: np.arange(len(data.train_y))})[0]
    plan = _plan(config)
    if not 0 <= client_id < plan.client_count:
        raise UserError(f"client_id={client_id} is not a client of this run; allowed: 0 to {plan.client_count - 1}")
    return plan.node(client_id)


def client_count(raw: Mapping[str, Any]) -> int:
    """How many client nodes the run `raw` configures (the partition's clients; centralized: one)."""
    return _plan(resolve_config(raw)).client_count


def _stored_summaries(config: ResolvedConfig) -> list[dict[str, Any]] | None:
    """The class counts the clients of a data=own run reported when it began (its partition.json),
    which they must report again when it is resumed; None for a run that starts."""
    path = config.out_dir / "partition.json"
    if not config.run.resume or not path.exists():
        return None
    try:
        counts = json.loads(path.read_text())["counts"]
        if len(counts) != config.run.clients or not all(isinstance(c, list) for c in counts):
            raise ValueError(f"counts for {len(counts)} clients")
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise UserError(f"cannot resume: {str(path)!r} does not hold the clients' class counts ({error})") from None
    return [{"class_counts": held} for held in counts]


def check(raw: Mapping[str, Any]) -> None:
    """Everything about a run that can be checked without building its roles (settings, out,
    logger, device, dataset, partition, cut, subsets): UserError if `build` would refuse it. A
    sweep checks all its runs so before the first one starts."""
    config = resolve_config(raw)
    rundir.check_out_dir(config.out_dir)
    check_logger(config.run.logger)
    if config.run.setting == "vertical":
        from splitlab.vertical import plan_vertical

        plan_vertical(config)
    elif config.run.data == "partition":
        plan = _plan(config)
        _seeded_subset(len(plan.data.test_y), config.run.test_subset, config.run.seed, "test_subset")


def build(raw: Mapping[str, Any], transport: Callable[[Ledger, torch.device], Transport] | None = None) -> Experiment:
    """Validate the config and build data, roles, transport and algorithm; UserError on bad input.
    `transport` makes the transport (default: the config's); one with `remote` clients (a network)
    reaches client nodes built elsewhere, and none is built here. With backend=ray, client nodes
    and the training server are built in Ray actors (splitlab.ray_backend)."""
    config = resolve_config(raw)
    run = config.run
    rundir.check_out_dir(config.out_dir)
    if run.resume and not run.overwrite:
        rundir.check_resume_target(config.out_dir)
    check_logger(run.logger)
    if transport is not None and run.backend == "ray":
        raise UserError("backend=ray runs clients on Ray actors; a networked server takes backend=local")
    if run.setting == "vertical":  # parties holding features, not samples: splitlab.vertical
        from splitlab.vertical import build_vertical

        return build_vertical(config, transport)
    if run.data == "own" and transport is None:
        raise UserError("data=own: the clients bring their own samples to a server; run it with `splitlab server`")
    plan = _plan(config)
    data, blueprint, algorithm_class, device = plan.data, plan.blueprint, plan.algorithm_class, plan.blueprint.device
    ledger = Ledger(run.ledger)
    counts = plan.class_counts()
    report = plan.partition_report
    roles: Roles | None = None
    transport_: Transport
    server: object
    sync = algorithm_class.Sync(blueprint)
    if run.backend == "ray":
        from splitlab import ray_backend

        transport_ = ray_backend.RayTransport(ledger, device, run.workers)
        assert plan.owners is not None
        client_roles, server = ray_backend.start_roles(
            config, plan.data, plan.owners, plan.held_out, blueprint, transport_
        )
        client_proxies = {k: transport_.connect(role, counted=True) for k, role in client_roles.items()}
    else:
        transport_ = (transport or TRANSPORTS[run.transport])(ledger, device)
        if transport_.remote:  # each client must report the data it holds: the partition's, or a resumed run's
            nodes: list[ClientNode] = []
            expected = plan.data_summaries() or _stored_summaries(config)
            client_proxies = {
                k: transport_.connect_remote(k, algorithm_class.Client, blueprint, expected[k] if expected else None)
                for k in range(plan.client_count)
            }
            if counts is None:  # data=own: what the clients hold is known once they have all reported
                counts = transport_.reported_counts()
                report = counts_report(counts, blueprint.num_classes)
        else:
            nodes = [plan.node(k) for k in range(plan.client_count)]
            client_proxies = {node.id: transport_.connect(node, counted=True) for node in nodes}
        roles = Roles(nodes, algorithm_class.Server(blueprint), sync)
        server = roles.server
    assert counts is not None and report is not None
    clients = [ClientInfo(k, sum(held)) for k, held in enumerate(counts)]
    context = Context(
        run,
        config.params,
        clients,
        client_proxies,
        transport_.connect(server, counted=False),
        transport_.connect(sync, counted=False),
        transport_.concurrency,
        transport_.drop if transport_.remote else None,
        transport_.lease,
    )
    algorithm = algorithm_class(context)
    transport_.on_rejoin = algorithm.rejoined
    if blueprint.defense.random:  # each party's own noise key (splitlab.privacy.keys)
        secret = keys.from_setting(run.noise_key) if run.noise_key is not None else keys.fresh()
        install_noise_secret(blueprint, transport_, secret)
    test_x, test_y = test_set(config, data, device)
    data = dataclasses.replace(
        data,
        train_x=data.train_x[:0],
        train_y=data.train_y[:0],
        train_groups=None,
        test_x=test_x,
        test_y=test_y,
        prepare=None,
    )  # the test set, prepared once
    return Experiment(config, data, clients, algorithm, report, roles, blueprint, transport_, plan.client_test)


def sample_clients(clients: list[ClientInfo], participation: float, rng: np.random.Generator) -> list[ClientInfo]:
    """round(C*K) clients (at least one), in id order."""
    count = max(1, round(participation * len(clients)))
    chosen = np.sort(rng.choice(len(clients), count, replace=False))
    return [clients[k] for k in chosen]


def evaluate(experiment: Experiment) -> dict[str, float]:
    """Test metrics of the model assembled from the roles' states (fetched through the transport,
    as telemetry). With test_split=client, every client's model is run on its own held-out
    samples and the metrics are computed on all of them pooled (accuracy and loss are then the
    test-size-weighted means of the per-client values). On the global test set, algorithms with
    personal client models get the unweighted mean over clients of each client's model's metrics."""
    data, algorithm, batch = experiment.data, experiment.algorithm, experiment.blueprint.inference_batch
    metrics = TASK_METRICS[data.task]
    if experiment.client_test is not None:
        held = [(k, x, y) for k, (x, y) in enumerate(experiment.client_test) if len(y)]
        where_they_are = getattr(experiment.transport, "personal_logits", None)  # backend=ray: on the actors
        logits = (
            where_they_are(algorithm, [k for k, _, _ in held])
            if where_they_are is not None and algorithm.personal_models
            else [logits_in_batches(experiment.assemble(algorithm.personal_model(k)), x, batch) for k, x, _ in held]
        )
        return metrics(torch.cat(logits), torch.cat([y for _, _, y in held]))
    if algorithm.personal_models:
        ids = [c.id for c in experiment.clients]
        where_they_are = getattr(experiment.transport, "personal_metrics", None)  # backend=ray: on the actors
        per_client = (
            where_they_are(algorithm, ids)
            if where_they_are is not None
            else [
                personal_metrics(
                    experiment.assemble, algorithm.personal_model(k), data.test_x, data.test_y, batch, metrics
                )
                for k in ids
            ]
        )
        return {key: float(np.mean([m[key] for m in per_client])) for key in per_client[0]}
    model = algorithm.global_model()
    if model is None:
        raise NotImplementedError(f"{algorithm.name} has no global model and no personal models")
    return metrics(logits_in_batches(experiment.assemble(model), data.test_x, batch), data.test_y)


def personal_metrics(
    assemble: Callable[[list[State]], nn.Module],
    states: list[State],
    x: torch.Tensor,
    y: torch.Tensor,
    batch: int,
    metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float]],
) -> dict[str, float]:
    """The test metrics of one client's personal model (in the driver, or in the Ray actor holding it)."""
    return metrics(logits_in_batches(assemble(states), x, batch), y)


DEPLOYED_NOTE = (
    "final_accuracy: the model without the defense at the cut (undefended path); "
    "final_accuracy_deployed: with the defense applied at the cut, as deployed"
)


def evaluate_deployed(experiment: Experiment, rnd: int) -> dict[str, float]:
    """`test_accuracy_deployed`: a defended global split model's test accuracy with the defense
    applied at the cut as deployed (clipping, noise, compression); `test_accuracy` is the
    undefended path. Empty where the defense leaves the forward pass as it is. Called right after
    `evaluate`, whose global model it reuses (assembled there: not fetched twice)."""
    defense, parts = experiment.blueprint.defense, experiment.assembler.parts
    if not defense.changes_forward or len(parts) != 2 or experiment.algorithm.personal_models:
        return {}
    client, server = parts
    generator = torch.Generator(experiment.blueprint.device).manual_seed(experiment.config.run.seed * 1_000_003 + rnd)
    deployed = defense.deployed(client, server, generator)
    if isinstance(client, HeadAndTail):  # U-shaped: the client's tail after the server's stages
        deployed = nn.Sequential(deployed, client.tail_part())
    logits = logits_in_batches(deployed, experiment.data.test_x, experiment.blueprint.inference_batch)
    metrics = TASK_METRICS[experiment.data.task](logits, experiment.data.test_y)
    return {"test_accuracy_deployed": metrics["accuracy"]}


class _RunDirectory:
    """The run's files, and the rules for starting, resuming or replacing them."""

    def __init__(self, experiment: Experiment) -> None:
        self.path = experiment.out
        self.config = experiment.config

    def existing(self) -> list[str]:
        return [name for name in RUN_FILES if (self.path / name).exists()]

    def check_resumable(self) -> None:
        # A key the stored config lacks (added to splitlab after the run began) counts as its default.
        stored = {**self.config.defaults(), **rundir.stored_config(self.path)}
        current = self.config.as_dict()
        differing = sorted(k for k in current if k not in RUN_CONTROL_KEYS and stored.get(k) != current[k])
        if differing:
            key = differing[0]
            raise UserError(
                f"cannot resume {str(self.path)!r}: {key}={current[key]!r} differs from the "
                f"stored {stored.get(key)!r}; use overwrite=true to start over"
            )

    def clear(self) -> None:
        rundir.clear(self.path)

    def summary(self) -> dict[str, Any]:
        """The summary of the finished run here; UserError if summary.json is unreadable."""
        file = self.path / "summary.json"
        try:
            summary = json.loads(file.read_text())
            if not isinstance(summary, dict) or "final_accuracy" not in summary:
                raise ValueError("not a run's summary")
        except (ValueError, UnicodeDecodeError) as error:
            raise UserError(
                f"cannot resume {str(self.path)!r}: its summary.json is unreadable ({str(error)[:80]}); "
                f"use overwrite=true to run it again"
            ) from None
        return summary


def run(
    config: Mapping[str, Any],
    *,
    resume: bool | None = None,
    progress: bool = True,
    transport: Callable[[Ledger, torch.device], Transport] | None = None,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Run (or resume) one experiment; returns the summary that is also written to summary.json.
    `transport`: as for `build` (splitlab.net's server passes its network transport);
    `callbacks`: hooks of your own into the loop, called after splitlab's (splitlab.callbacks).

    When a process holding roles is lost (backend=ray: an actor or its node died), the roles are
    built again and the run replays from its last checkpoint (from the start if it has none yet),
    as a resumed run would: bit for bit the same results. After `max_restarts` such losses, or when
    the roles cannot be built again (the nodes left lack the CPUs), the run stops with one line
    and the resume hint."""
    prepare_process()
    experiment = build(config, transport)
    limit = experiment.config.run.max_restarts
    restarts = 0
    while True:
        try:
            with contextlib.closing(experiment.transport):
                return _run(experiment, resume, progress, callbacks)
        except RoleLost as lost:
            restarts += 1
            if restarts > limit:
                raise RoundFailed(
                    f"{lost}; stopped after max_restarts={limit} restarts: run it again with resume=true "
                    f"to go on from its last checkpoint"
                ) from None
            LOGGER.warning(
                f"{lost}: building the roles again and replaying from the last checkpoint "
                f"(restart {restarts} of at most {limit})"
            )
            try:
                experiment = build({**config, "resume": True, "overwrite": False}, transport)
            except UserError as refused:  # what is left of the cluster cannot hold the roles (fewer CPUs)
                raise RoundFailed(
                    f"{lost}; the roles could not be built again: {refused}; then run it again with resume=true "
                    f"to go on from its last checkpoint"
                ) from None
            resume = True


def _run(
    experiment: Experiment, resume: bool | None, progress: bool, callbacks: Sequence[Callback] = ()
) -> dict[str, Any]:
    run_config = experiment.config.run
    resume = run_config.resume if resume is None else resume
    directory = _RunDirectory(experiment)
    kept = lambda: rundir.kept_after_interruption(directory.path)  # noqa: E731
    with rundir.file_errors(directory.path, kept), rundir.locked(directory.path):
        existing = directory.existing()
        if existing and run_config.overwrite:
            directory.clear()
        elif existing and not resume:
            raise UserError(
                f"out {str(directory.path)!r} already holds a run; use resume=true to continue it "
                f"or overwrite=true to replace it"
            )
        elif existing:
            directory.check_resumable()
            if "summary.json" in existing:
                return directory.summary()
            if CHECKPOINT not in existing:
                LOGGER.info(f"{str(directory.path)!r} holds no checkpoint: starting again at round 1")
        try:
            return _loop(experiment, progress, callbacks)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the CLI says what was kept
            raise KeyboardInterrupt(rundir.kept_after_interruption(directory.path)) from None


def install_noise_secret(blueprint: Blueprint, transport: Transport, secret: bytes) -> None:
    """The noise secret of the parties this process plays (and of its Ray actors', which it also plays)."""
    blueprint.noise_secret = secret
    if blueprint.config.backend == "ray":
        from splitlab import ray_backend

        ray_backend.install_noise_secret(cast(ray_backend.RayTransport, transport), secret)


def role_states(experiment: Experiment) -> dict[str, Any]:
    """Every role's state that outlives a round (fetched through the transport), the ledger's,
    and the noise secret of the parties played here (kept with their state, never elsewhere)."""
    algorithm, ledger = experiment.algorithm, experiment.ledger
    secret = experiment.blueprint.noise_secret
    return {
        **({"noise_secret": torch.tensor(list(secret), dtype=torch.uint8)} if secret is not None else {}),
        "algorithm": algorithm.state_dict(),
        "server": algorithm.server.state_dict(),
        "sync": algorithm.sync.state_dict(),
        "clients": algorithm.client_states(),
        "ledger": {
            "bytes_by_kind": ledger.state_dict(),
            "bytes_by_client": {str(k): n for k, n in ledger.bytes_by_client.items()},
            "envelope_bytes": ledger.envelope_bytes,
            "wire_bytes": ledger.wire_bytes,
        },
    }


def restore(experiment: Experiment, state: dict[str, Any]) -> None:
    """Load `role_states` into a freshly built experiment."""
    algorithm, ledger = experiment.algorithm, experiment.ledger
    if "noise_secret" in state:
        install_noise_secret(experiment.blueprint, experiment.transport, bytes(state["noise_secret"].tolist()))
    algorithm.load_state_dict(state["algorithm"])
    algorithm.server.load_state_dict(state["server"])
    algorithm.sync.load_state_dict(state["sync"])
    algorithm.load_client_states(state["clients"])
    ledger.bytes_by_kind = dict(state["ledger"]["bytes_by_kind"])
    ledger.bytes_by_client = {int(k): int(n) for k, n in state["ledger"].get("bytes_by_client", {}).items()}
    ledger.envelope_bytes = int(state["ledger"]["envelope_bytes"])
    ledger.wire_bytes = int(state["ledger"].get("wire_bytes", 0))


SNAPSHOT_SHARE = 0.02
"""The most of a run's time that taking checkpoint snapshots may hold up training (checkpoint_every > 0)."""


class _Checkpointer:
    """Snapshots of every role's state, copied in the loop and written to disk in the background.

    A snapshot is one copy of the tensors, streamed from its memory to the file while training
    goes on (building the file's bytes in memory first took twice the memory and, for FSL-SAGE's
    1.2 GB state, 8 s of page faults); one write at a time, and a snapshot waits for the previous
    write. A snapshot is taken when `every` seconds have passed since the last one (0: after
    every round), and never sooner than its in-loop cost allows: a snapshot that held the loop for
    s seconds is followed by at least s / SNAPSHOT_SHARE seconds of training, so large states
    (FSL-SAGE's aux models and buffers) cost the same share."""

    def __init__(self, experiment: Experiment) -> None:
        self.experiment = experiment
        self.path = experiment.out / CHECKPOINT
        self.every = experiment.config.run.checkpoint_every
        self._last = time.monotonic()
        self._interval = self.every
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def load(self) -> dict[str, Any] | None:
        """The loop state of the last checkpoint, with every role restored; None if there is none."""
        if not self.path.exists():
            return None
        try:
            state = codec.decode(self.path.read_bytes(), self.experiment.blueprint.device)
            restore(self.experiment, state)
        except (codec.MessageError, KeyError, TypeError, ValueError, RuntimeError) as error:
            raise UserError(
                f"cannot resume from {str(self.path)!r}: the checkpoint is unreadable "
                f"({str(error).splitlines()[0][:120]}); use overwrite=true to start over"
            ) from None
        return state["loop"]

    def maybe_save(self, loop: dict[str, Any], force: bool = False) -> None:
        if not force and time.monotonic() - self._last < self._interval:
            return
        started = time.monotonic()
        snapshot = codec.flatten({"loop": loop, **role_states(self.experiment)}, copy=True)
        self.wait()
        self._writer = threading.Thread(target=self._write, args=snapshot, daemon=True)
        self._writer.start()
        self._last = time.monotonic()
        if self.every:
            self._interval = max(self.every, (self._last - started) / SNAPSHOT_SHARE)

    def _write(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        try:
            write_safetensors(self.path, tensors, metadata)
        except BaseException as error:  # surfaced by wait(), in the loop's thread
            self._error = error

    def wait(self) -> None:
        """Wait for the write in progress; raise its error, if it failed."""
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def join(self) -> None:
        """Wait for the write in progress (also when the loop stops on an error: a started
        checkpoint is finished, never left half-written or lost)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def remove(self) -> None:
        self.wait()
        self.path.unlink(missing_ok=True)


def _callbacks(experiment: Experiment, show_progress: bool, extra: Sequence[Callback]) -> list[Callback]:
    """The loop's callbacks, in the order they are called: files first, then trackers, progress,
    the caller's."""
    cfg, out, ledger = experiment.config.run, experiment.out, experiment.ledger
    callbacks: list[Callback] = [MetricsFile(out)]
    if experiment.blueprint.recorder is not None:
        callbacks.append(RecorderFlush(experiment.blueprint.recorder, out))
    if cfg.comm_budget_gib is not None:
        callbacks.append(CommBudget(ledger, cfg.comm_budget_gib))
    tracker = make_logger(cfg.logger, out, experiment.config.as_dict())
    if tracker is not None:
        callbacks.append(tracker)
    if show_progress:
        callbacks.append(ProgressBar(f"{cfg.algorithm} rounds", cfg.rounds, ledger))
    return [*callbacks, *extra]


def _loop(experiment: Experiment, show_progress: bool, extra: Sequence[Callback] = ()) -> dict[str, Any]:
    cfg = experiment.config.run
    algorithm, out = experiment.algorithm, experiment.out
    checkpoints = _Checkpointer(experiment)
    state: dict[str, Any] = checkpoints.load() or {
        "round": 0,
        "metrics": [],
        "wall_seconds": 0.0,
        "stopped_by": "rounds",
    }
    if state["round"] == 0:
        write_yaml(out / "config.yaml", experiment.config.as_dict())
        write_json(out / "partition.json", experiment.partition_report)

    with contextlib.ExitStack() as cleanup:
        cleanup.callback(checkpoints.join)
        callbacks = _callbacks(experiment, show_progress, extra)
        for callback in callbacks:
            callback.on_run_start(state)
            cleanup.callback(callback.on_run_end, state)
        while state["round"] < cfg.rounds and state["stopped_by"] == "rounds":
            rnd = state["round"]
            torch.manual_seed(cfg.seed * 1_000_003 + rnd)  # dropout etc. depend on (seed, round) only
            clients = sample_clients(
                experiment.clients, cfg.participation, random_stream(cfg.seed, rnd, STREAM_SAMPLING)
            )
            started = time.perf_counter()
            try:
                with _needs_the_client(cfg.algorithm, rnd + 1):
                    algorithm.run_round(rnd, clients)
            except NonFiniteStep as step:  # in process, or no one client to blame: training diverged
                _check_finite(step.value, f"server's {step.what}", rnd + 1)
            _check_enough_finished(experiment, clients, rnd + 1)
            state.setdefault("dropped", []).extend([rnd + 1, k] for k in sorted(algorithm.dropped))
            train_loss = algorithm.pop_train_loss()
            _check_finite(train_loss, "training loss", rnd + 1)
            compute_seconds = experiment.blueprint.pop_seconds()
            for phase, seconds in experiment.transport.pop_seconds().items():  # roles in other processes
                compute_seconds[phase] = compute_seconds.get(phase, 0.0) + seconds
            state["wall_seconds"] += time.perf_counter() - started
            state["round"] = rnd + 1
            stops = [reason for callback in callbacks if (reason := callback.on_round_trained(state)) is not None]
            if stops:
                state["stopped_by"] = stops[0]
            row = None
            if state["round"] % cfg.eval_every == 0 or state["round"] == cfg.rounds or stops:
                with _needs_the_client(cfg.algorithm, rnd + 1):  # personal models are fetched from clients
                    row = _metrics_row(experiment, state, train_loss, compute_seconds)
                _check_finite(row["test_loss"], "test loss", state["round"])
                state["metrics"].append(row)
            for callback in callbacks:
                callback.on_round_end(state, row)
            if state["round"] < cfg.rounds and state["stopped_by"] == "rounds":
                checkpoints.maybe_save(state)
    checkpoints.wait()
    summary = _finish(experiment, state)
    checkpoints.remove()
    return summary


def _export_hf(experiment: Experiment) -> bool:
    """out/hf: the global model as a Hugging Face folder, for models that have that form (model=gpt, hf)."""
    from splitlab.runmodel import export_hf

    parts = experiment.assembler.parts  # full_state assembled the model
    return export_hf(experiment.config.run, parts, experiment.data.vocabulary, experiment.out / "hf")


@contextlib.contextmanager
def _needs_the_client(algorithm: str, round_number: int) -> Iterator[None]:
    """A client dropped out of a step that cannot go on without it (the evaluation of its personal
    model, SplitGP's final per-client weights): the run stops with one line."""
    try:
        yield
    except ClientDropped as dropped:
        raise RoundFailed(
            f"round {round_number}: {dropped}, in a step {algorithm} cannot finish without it; "
            f"restart the client and add resume=true"
        ) from None


def _check_finite(loss: float | None, what: str, round_number: int) -> None:
    if loss is not None and not math.isfinite(loss):
        raise NonFiniteLoss(
            f"the {what} became {loss} in round {round_number}: training diverged; lower lr "
            f"(or use optimizer=adam) and start again with overwrite=true"
        )


def _metrics_row(
    experiment: Experiment, state: dict, train_loss: float | None, compute_seconds: dict[str, float]
) -> dict[str, Any]:
    ledger = experiment.ledger
    test = evaluate(experiment)
    return {
        "round": state["round"],
        **{f"test_{key}": value for key, value in test.items()},
        **evaluate_deployed(experiment, state["round"]),
        "train_loss": train_loss,
        "comm_bytes": ledger.total_bytes,
        "comm_gib": ledger.total_bytes / GIB,
        "comm_bytes_by_kind": ledger.state_dict(),
        **_envelope(experiment),
        "wall_seconds": state["wall_seconds"],
        "round_compute_seconds": compute_seconds,
        **experiment.transport.pop_telemetry(),
        **_dropouts(experiment, state),
    }


def _envelope(experiment: Experiment) -> dict[str, int]:
    """The serialized transport's encoded bytes (every message, server-side ones included); over a
    network, also the bytes of every protobuf message sent or received (`wire_bytes`)."""
    ledger, transport = experiment.ledger, experiment.transport
    figures = {"envelope_bytes": ledger.envelope_bytes} if transport.name != "direct" else {}
    return {**figures, "wire_bytes": ledger.wire_bytes} if transport.remote else figures


def _dropouts(experiment: Experiment, state: dict) -> dict[str, Any]:
    """Over a network: the clients that dropped out since the last row, as [round, client id] pairs."""
    if not experiment.transport.remote:
        return {}
    dropped, state["dropped"] = state.get("dropped", []), []
    return {"dropped_clients": dropped}


def _check_enough_finished(experiment: Experiment, clients: list[ClientInfo], round_number: int) -> None:
    """Fewer than `min_clients` (or all sampled, if fewer) finished the round: the run stops there."""
    dropped = experiment.algorithm.dropped
    needed = min(experiment.transport.min_clients, len(clients))
    finished = sum(c.id not in dropped for c in clients)  # (vanilla SL's holder may be of an earlier round)
    non_finite = experiment.algorithm.non_finite
    if finished == 0 and non_finite:
        others = ", the others left" if len(non_finite) < len(clients) else ""
        raise NonFiniteLoss(
            f"round {round_number}: no client is left: client(s) {', '.join(map(str, sorted(non_finite)))} "
            f"dropped, their data made the server's loss or gradients non-finite{others}; if every "
            f"client's did, training diverged: lower lr (or use optimizer=adam) and start again"
        )
    if finished < needed:
        raise RoundFailed(
            f"round {round_number}: only {finished} of {len(clients)} clients finished "
            f"(dropped: {', '.join(map(str, sorted(dropped)))}), fewer than min_clients={needed}; "
            f"restart the clients and add resume=true"
        )


def _finish(experiment: Experiment, state: dict) -> dict[str, Any]:
    cfg, out = experiment.config.run, experiment.out
    rows = state["metrics"]
    best = max(rows, key=lambda row: row["test_accuracy"])
    ledger = experiment.ledger
    summary = {
        "algorithm": cfg.algorithm,
        "dataset": cfg.dataset,
        "model": cfg.model,
        "cut": cfg.cut,
        **({"tail_cut": cfg.tail_cut} if cfg.tail_cut is not None else {}),
        "seed": cfg.seed,
        "partition": cfg.partition,
        "clients": len(experiment.clients),
        "rounds_completed": state["round"],
        "final_accuracy": rows[-1]["test_accuracy"],
        "best_accuracy": best["test_accuracy"],
        "best_round": best["round"],
        **{
            f"final_{key[5:]}": value
            for key, value in rows[-1].items()
            if key.startswith("test_") and key != "test_accuracy"
        },
        "total_bytes": ledger.total_bytes,
        "total_gib": ledger.total_bytes / GIB,
        "comm_bytes_by_kind": ledger.state_dict(),
        "comm_bytes_by_client": {str(k): n for k, n in sorted(ledger.bytes_by_client.items())},
        **_envelope(experiment),
        "wall_seconds": state["wall_seconds"],
        "stopped_by": state["stopped_by"],
        "target_accuracy": cfg.target_accuracy,
        **dict(zip(("rounds_to_target", "gib_to_target"), to_target(rows, cfg.target_accuracy))),
        **privacy_summary(cfg),
    }
    if "test_accuracy_deployed" in rows[-1]:
        summary["final_accuracy_deployed"] = rows[-1]["test_accuracy_deployed"]
        summary["accuracy_paths"] = DEPLOYED_NOTE
    model = experiment.algorithm.shared_model()
    if model is not None:  # with personal client parts, the server part alone
        personal = experiment.algorithm.personal_models
        weights = experiment.assembler.server_state(model[-1]) if personal else experiment.full_state(model)
        save_safetensors(out / "weights.safetensors", weights)
        if not personal and _export_hf(experiment):  # one global model to export
            summary["hf_export"] = str(out / "hf")
    with _needs_the_client(cfg.algorithm, state["round"]):  # SplitGP's are fetched from the clients
        client_weights = experiment.algorithm.client_weights()
    if client_weights is not None:
        save_safetensors(out / "clients.safetensors", client_weights)
    write_json(out / "summary.json", summary)
    return summary
