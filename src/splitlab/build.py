"""Planning and building a run: its data, partition, blueprint, roles, transport and algorithm.

`build(config)` validates everything and builds the whole experiment before the engine writes a
byte, so a bad setting never leaves a half-made run directory; `check` does the same checks
without building the roles, for a sweep to check all its runs first. A networked client builds
its own node with `client_node`, from the same plan as the server's.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from splitlab import ray_backend, rundir
from splitlab.algorithms import get_algorithm
from splitlab.algorithms.base import Algorithm, ClientInfo, Context
from splitlab.assembly import (
    Experiment,
    Roles,
    client_nodes,
    load_data,
    make_blueprint,
    resolve_device,
    seeded_subset,
    test_set,
)
from splitlab.config import ResolvedConfig, RunConfig, parse_lora, parse_test_split, parse_train_range
from splitlab.data import Dataset, counts_report, load_split, partition, partition_report
from splitlab.data.datasets import data_summary
from splitlab.errors import UserError
from splitlab.ledger import Ledger
from splitlab.loggers import check_logger
from splitlab.models import StagedModel, split
from splitlab.models.lora import apply_lora, linear_layer_names, load_init
from splitlab.privacy import keys
from splitlab.privacy.defenses import check_task, parse_defense
from splitlab.resolve import resolve_config
from splitlab.roles import Blueprint, ClientNode
from splitlab.runmodel import init_shapes, init_state
from splitlab.transport import TRANSPORTS, Transport
from splitlab.vertical import party_node, plan_vertical
from splitlab.vertical_build import build_vertical


def client_indices(config: ResolvedConfig, data: Dataset) -> list[np.ndarray]:
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
    pool = users[seeded_subset(len(users), run.train_subset, run.seed, "train_subset")]
    parts = partition(data.train_labels.numpy()[pool], run.clients, run.partition, run.seed)
    return [pool[part] for part in parts]


def hold_out(indices: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
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
    assert run.setting != "vertical", "a vertical run's parties are planned by splitlab.vertical"
    check_model(config)
    device = resolve_device(run.device)
    if run.data == "own":
        return _own_data_plan(config, device)
    data = load_data(config)
    _check_task(config, data)
    indices = client_indices(config, data)
    held_out = parse_test_split(run.test_split)
    client_test, held = None, None
    if held_out is not None:
        indices, held = hold_out(indices, held_out, run.seed)  # prepared once, for every evaluation
        client_test = [(data.inputs(data.train_x[idx].to(device)), data.train_y[idx].to(device)) for idx in held]
    report = partition_report(data.train_labels.numpy(), indices, data.num_classes)
    algorithm_class = get_algorithm(run.algorithm)
    blueprint = make_blueprint(config, data, device, init_state(config))
    _check_cut(blueprint, algorithm_class)
    owners = algorithm_class.data_owners(indices)
    return _Plan(config, data, owners, client_test, report, algorithm_class, blueprint, held)


def _check_cut(blueprint: Blueprint, algorithm_class: type[Algorithm]) -> None:
    check_split(blueprint.new_model(), blueprint.config, algorithm_class)


def check_split(model: StagedModel, run: RunConfig, algorithm_class: type[Algorithm]) -> None:
    """A cut outside the model's range, or one that leaves a part that trains nothing to train (a
    frozen base whose adapters are all in the other part), in one line naming what would do."""
    client, server = split(model, run.cut, run.tail_cut)
    for side, part, slot in (("client", client, "client_model"), ("server", server, "server_model")):
        if slot not in algorithm_class.models or any(p.requires_grad for p in part.parameters()):
            continue
        cut = run.cut if run.tail_cut is None else f"{run.cut},{run.tail_cut}"
        why = f"cut={cut} leaves the {side} part nothing to train (lora trains only its adapters, none in that part)"
        fitting = [
            str(c)
            for c in model.valid_cuts
            if run.tail_cut is None and all(any(p.requires_grad for p in half.parameters()) for half in split(model, c))
        ]
        layers = linear_layer_names(part)
        raise UserError(
            why
            + (f"; cuts that train both parts: {', '.join(fitting)}" if fitting else "")
            + (f"; or add to lora_targets one of the {side} part's layers: {', '.join(layers)}" if layers else "")
        )


def check_model(config: ResolvedConfig) -> None:
    """What can be checked of model=hf before its data is read and tokenised (seconds for a
    corpus): its folder and architecture, the sequence length, the LoRA targets, the cut, and that
    init= fits, on the model's skeleton (no weights)."""
    run, model_dir = config.run, config.model_dir
    if model_dir is None:
        return
    from splitlab.models import hf

    model = hf.skeleton(model_dir)
    context = hf.context_length(hf.read_config(model_dir))
    if run.seq_len is not None and run.seq_len > context:
        raise UserError(f"seq_len={run.seq_len} is beyond the model's context of {context} tokens")
    if run.lora is not None:
        targets = run.lora_targets.split(",") if run.lora_targets is not None else None
        apply_lora(model, *parse_lora(run.lora), targets, run.lora_dropout, run.seed)
    shapes = init_shapes(config)
    if shapes is not None:
        load_init(model, shapes, f"init={run.init}")
    check_split(model, run, get_algorithm(run.algorithm))


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
    check_task(parse_defense(run.defense), run.defense, run.dataset, data.task, data.num_classes)
    if run.eval_generate and data.references is None:
        raise UserError(
            f"eval_generate={run.eval_generate}: {run.dataset} has no reference texts to score generations "
            f"against; datasets with references: e2e"
        )
    if run.eval_generate and algorithm.personal_models:
        raise UserError(f"eval_generate needs one global model; algorithm={run.algorithm} keeps a model per client")
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
    blueprint = make_blueprint(config, data, device, init_state(config))
    _check_cut(blueprint, algorithm_class)
    return _Plan(config, data, None, None, None, algorithm_class, blueprint)


def client_node(raw: Mapping[str, Any], client_id: int) -> ClientNode:
    """Client node `client_id` of the run `raw` configures, built in this process (a networked
    client): the same samples, batches and initial weights as the node `build` would make. With
    data=own, its samples are every training sample in `data_dir` (the client's own)."""
    config = resolve_config(raw)
    run = config.run
    if run.setting == "vertical":  # a party holding some features: splitlab.vertical
        return party_node(config, client_id)
    if run.data == "own":
        if run.clients != "all" and not 0 <= client_id < run.clients:
            raise UserError(f"client_id={client_id} is not a client of this run; allowed: 0 to {run.clients - 1}")
        data = load_split(run.dataset, "train", run.data_dir)
        blueprint = make_blueprint(config, data, resolve_device(run.device), init_state(config))
        return client_nodes(blueprint, data, {client_id: np.arange(len(data.train_y))})[0]
    plan = _plan(config)
    if not 0 <= client_id < plan.client_count:
        raise UserError(f"client_id={client_id} is not a client of this run; allowed: 0 to {plan.client_count - 1}")
    return plan.node(client_id)


def client_count(raw: Mapping[str, Any]) -> int:
    """How many client nodes the run `raw` configures (the partition's clients; centralized: one;
    vertical: the parties)."""
    config = resolve_config(raw)
    return config.run.parties if config.run.setting == "vertical" else _plan(config).client_count


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
        plan_vertical(config)
    elif config.run.data == "partition":
        plan = _plan(config)
        seeded_subset(len(plan.data.test_y), config.run.test_subset, config.run.seed, "test_subset")


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
            client_proxies = transport_.connect_remote(
                dict.fromkeys(range(plan.client_count), algorithm_class.Client),
                blueprint,
                {k: expected[k] if expected else None for k in range(plan.client_count)},
            )
            if counts is None:  # data=own: what the clients hold is known once they have all reported
                counts = transport_.reported_counts()
                report = counts_report(counts, blueprint.num_classes)
        else:
            nodes = [plan.node(k) for k in range(plan.client_count)]
            client_proxies = {node.id: transport_.connect(node, counted=True) for node in nodes}
        roles = Roles(nodes, algorithm_class.Server(blueprint), sync)
        roles.server.checks_each_step = transport_.remote  # in process, a non-finite step means divergence
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
        transport_.install_noise_secret(blueprint, keys.for_run(run.noise_key))
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
