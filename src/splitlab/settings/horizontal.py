"""The horizontal setting (setting=vanilla): every client holds whole samples, its share of the
dataset's partition (data=partition), or its own files, which it reports to a server (data=own).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.assembly import client_nodes, load_data, make_blueprint, resolve_device, seeded_subset, test_set
from splitlab.config import ResolvedConfig, RunConfig, parse_lora, parse_test_split, parse_train_range
from splitlab.data import Dataset, counts_report, load_split, partition, partition_report
from splitlab.data.datasets import data_summary
from splitlab.errors import UserError, refuse
from splitlab.json_text import file_json
from splitlab.models import StagedModel, build_model, split
from splitlab.models.lora import ADAPTERS, apply_lora, linear_layer_names, load_init
from splitlab.privacy.defenses import check_task, parse_defense
from splitlab.roles import Blueprint, ClientNode, Role
from splitlab.run_weights import init_shapes, init_state
from splitlab.settings.base import SERVER, DataShape, Hosted, Plan, Reports, Setting, as_arrays, as_tensors
from splitlab.transport import Transport


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
class HorizontalPlan(Plan):
    """Clients holding samples: the dataset, each client node's samples, the blueprint."""

    config: ResolvedConfig
    data: Dataset
    owners: list[np.ndarray] | None  # the samples of each client node; None: the clients' own (data=own)
    client_test: list[tuple[torch.Tensor, torch.Tensor]] | None
    partition_report: dict | None  # data=own: from the clients' reports
    blueprint: Blueprint
    held_out: list[np.ndarray] | None = None  # test_split=client: the samples each client holds out

    @property
    def node_count(self) -> int:
        return len(self.owners) if self.owners is not None else int(self.config.run.clients)

    def node_class(self, k: int) -> type[ClientNode]:
        return self.algorithm_class.Client

    @property
    def server_class(self) -> type[Role]:
        return self.algorithm_class.Server

    def node(self, k: int) -> ClientNode:
        assert self.owners is not None, "data=own: the client nodes hold their own samples, elsewhere"
        return client_nodes(self.blueprint, self.data, {k: self.owners[k]}, self.algorithm_class.Client)[0]

    def server(self, remote: bool) -> Role:
        server = self.algorithm_class.Server(self.blueprint)
        server.checks_each_step = remote  # in process, a non-finite step means divergence
        return server

    def expected_reports(self) -> dict[int, dict[str, Any] | None]:
        """The partition's summary of each client's samples, or a resumed data=own run's (its
        partition.json); None: data=own, what each client first reports."""
        expected = self._data_summaries() or _stored_summaries(self.config)
        return {k: expected[k] if expected else None for k in range(self.node_count)}

    def _data_summaries(self) -> list[dict[str, Any]] | None:
        if self.owners is None:
            return None
        data = self.data
        return [data_summary(data.train_y[idx], data.task, data.num_classes) for idx in self.owners]

    def actor_loads(self, placed: list[list[int]]) -> list[Any]:
        """The dataset (its tensors as numpy arrays, which actors map without copying; the test split
        only where the actors evaluate personal models), every client's sample indices and those it
        holds out: the same object for every worker, put in Ray's object store once."""
        assert self.owners is not None, "data=own clients are `splitlab client` processes"
        data = self.data
        fields = {field.name: getattr(data, field.name) for field in dataclasses.fields(data)}
        fields["train_groups"] = None  # the partition is the driver's: the owners below
        if not self.algorithm_class.personal_models:
            fields["test_x"], fields["test_y"] = data.test_x[:0], data.test_y[:0]
        held = dict(enumerate(self.held_out)) if self.held_out is not None else None
        shared = {"dataset": as_arrays(fields), "owners": dict(enumerate(self.owners)), "held_out": held}
        return [shared] * len(placed)

    def clients(self, transport: Transport) -> tuple[list[ClientInfo], dict[str, Any]]:
        if self.owners is not None:
            labels = self.data.train_labels.numpy()
            counts = [np.bincount(labels[idx], minlength=self.blueprint.num_classes).tolist() for idx in self.owners]
            report = self.partition_report
        else:  # data=own: what the clients hold is known once they have all reported
            counts = transport.reported_counts()
            report = counts_report(counts, self.blueprint.num_classes)
        assert report is not None
        return [ClientInfo(k, sum(held)) for k, held in enumerate(counts)], report

    def test_data(self) -> Dataset:
        device = self.blueprint.device
        test_x, test_y = test_set(self.config, self.data, device)
        none = self.data.train_x[:0], self.data.train_y[:0]
        return dataclasses.replace(
            self.data, train_x=none[0], train_y=none[1], train_groups=None, test_x=test_x, test_y=test_y, prepare=None
        )


def _stored_summaries(config: ResolvedConfig) -> list[dict[str, Any]] | None:
    """The class counts the clients of a data=own run reported when it began (its partition.json),
    which they must report again when it is resumed; None for a run that starts."""
    path = config.out_dir / "partition.json"
    if not config.run.resume or not path.exists():
        return None
    try:
        counts = file_json(path.read_text())["counts"]
        if len(counts) != config.run.clients or not all(isinstance(c, list) for c in counts):
            raise ValueError(f"counts for {len(counts)} clients")
    except (ValueError, KeyError, TypeError, OSError) as error:
        raise UserError(f"cannot resume: {str(path)!r} does not hold the clients' class counts ({error})") from None
    return [{"class_counts": held} for held in counts]


class Horizontal(Setting):
    """Clients holding whole samples."""

    def check(self, config: ResolvedConfig) -> None:
        if config.run.data == "partition":
            plan = _plan(config)
            seeded_subset(len(plan.data.test_y), config.run.test_subset, config.run.seed, "test_subset")

    def plan(self, config: ResolvedConfig, elsewhere: bool, reports: Reports) -> HorizontalPlan:
        if config.run.data == "own" and not elsewhere:
            raise UserError("data=own: the clients bring their own samples to a server; run it with `splitlab server`")
        return _plan(config)

    def node_count(self, config: ResolvedConfig) -> int:
        if config.run.data == "own" and config.run.clients != "all":  # the clients that will report
            return config.run.clients
        return _plan(config).node_count

    def node_here(self, config: ResolvedConfig, k: int) -> ClientNode:
        run = config.run
        if run.data == "own":
            if run.clients != "all" and not 0 <= k < run.clients:
                raise UserError(f"client_id={k} is not a client of this run; allowed: 0 to {run.clients - 1}")
            data = load_split(run.dataset, "train", run.data_dir)
            check_task(parse_defense(run.defense), run.defense, run.dataset, data.task, data.num_classes)
            blueprint = make_blueprint(config, data, resolve_device(run.device), init_state(config))
            return client_nodes(blueprint, data, {k: np.arange(len(data.train_y))}, config.algorithm_class.Client)[0]
        plan = _plan(config)
        if not 0 <= k < plan.node_count:
            raise UserError(f"client_id={k} is not a client of this run; allowed: 0 to {plan.node_count - 1}")
        return plan.node(k)

    def host_nodes(
        self, config: ResolvedConfig, device: torch.device, load: Any, placed: list[int], shape: DataShape
    ) -> Hosted:
        data, owners, held_out = Dataset(**as_tensors(load["dataset"])), load["owners"], load["held_out"]
        blueprint = make_blueprint(config, data, device, init_state(config))
        Client = config.algorithm_class.Client

        def new_node(k: int) -> ClientNode:
            return client_nodes(blueprint, data, {k: owners[k]}, Client)[0]

        def held_out_x(k: int) -> torch.Tensor:
            return data.inputs(data.train_x[held_out[k]].to(device))

        personal = config.algorithm_class.personal_models  # evaluated on the actors, where the personal models are
        return Hosted(
            blueprint,
            {k: new_node(k) for k in placed},
            new_node,
            held_out_x if held_out is not None else None,
            test_set(config, data, device) if personal else None,
        )

    def host_server(self, config: ResolvedConfig, device: torch.device, load: Any, shape: DataShape) -> Hosted:
        """The training server holds no samples: it never loads them."""
        from splitlab.assembly import blueprint_of

        blueprint = blueprint_of(config, device, *shape, init_state(config))
        return Hosted(blueprint, {SERVER: config.algorithm_class.Server(blueprint)})


def _plan(config: ResolvedConfig) -> HorizontalPlan:
    run = config.run
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
    blueprint = make_blueprint(config, data, device, init_state(config))
    _check_cut(blueprint, config.algorithm_class)
    owners = config.algorithm_class.data_owners(indices)
    return HorizontalPlan(config, data, owners, client_test, report, blueprint, held)


def _check_cut(blueprint: Blueprint, algorithm_class: type[Algorithm]) -> None:
    check_split(blueprint.new_model(), blueprint.config, algorithm_class)


def check_split(model: StagedModel, run: RunConfig, algorithm_class: type[Algorithm]) -> None:
    """A cut outside the model's range, or one that leaves a part that trains nothing to train (a
    frozen base whose adapters are all in the other part), in one line naming what would do."""
    client, server = split(model, run.cut, run.tail_cut)
    adapted = any(name.endswith(ADAPTERS) for name, _ in model.named_parameters())
    for side, part, slot in (("client", client, "client_model"), ("server", server, "server_model")):
        if slot not in algorithm_class.models or any(p.requires_grad for p in part.parameters()):
            continue
        cut = run.cut if run.tail_cut is None else f"{run.cut},{run.tail_cut}"
        reason = "lora trains only its adapters, none in that part" if adapted else "it holds no trainable parameters"
        why = f"cut={cut} leaves the {side} part nothing to train ({reason})"
        fitting = [
            str(c)
            for c in model.valid_cuts
            if run.tail_cut is None and all(any(p.requires_grad for p in half.parameters()) for half in split(model, c))
        ]
        layers = linear_layer_names(part) if adapted else []
        raise UserError(
            why
            + (f"; cuts that train both parts: {', '.join(fitting)}" if fitting else "")
            + (f"; or add to lora_targets one of the {side} part's layers: {', '.join(layers)}" if layers else "")
        )


def check_model(config: ResolvedConfig) -> None:
    """What can be checked of a language model before its data is read and tokenised (seconds for a
    corpus): model=hf's folder and architecture, the sequence length, the LoRA targets, the cut, and
    that init= fits, on the model's skeleton (no weights)."""
    run = config.run
    model = _skeleton(config)
    if model is None:
        return
    shapes = init_shapes(config)
    if shapes is not None:
        load_init(model, shapes, f"init={run.init}")
    check_split(model, run, config.algorithm_class)


def _skeleton(config: ResolvedConfig) -> StagedModel | None:
    """The run's model on the meta device, adapters included, where it is known without the data:
    model=hf's from its folder; model=gpt's on a language dataset from LEAF's characters (its
    tokens) and its sizes. None for any other model."""
    run, model_dir = config.run, config.model_dir
    if model_dir is not None:
        from splitlab.models import hf

        context = hf.context_length(hf.read_config(model_dir))
        if run.seq_len is not None and run.seq_len > context:
            raise UserError(f"seq_len={run.seq_len} is beyond the model's context of {context} tokens")
        model = hf.skeleton(model_dir)
        if run.lora is not None:
            targets = run.lora_targets.split(",") if run.lora_targets is not None else None
            apply_lora(model, *parse_lora(run.lora), targets, run.lora_dropout, run.seed)
        return model
    if run.model != "gpt" or run.seq_len is None:  # seq_len: set for every language dataset (splitlab.resolve)
        return None
    from splitlab.data.language import characters

    with torch.device("meta"):
        return build_model(run.model, (run.seq_len,), len(characters()), run.seed, **config.model_settings())


def _check_task(config: ResolvedConfig, data: Dataset) -> None:
    """Refuse what a dataset's task does not allow: a class-based partition of sequences, or an
    algorithm whose design assumes the other task."""
    run, algorithm = config.run, config.algorithm_class
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
            f"against; datasets with references: e2e, and jsonl or hf_disk rows of prompt + completion or messages"
        )
    if run.eval_generate and algorithm.personal_models:
        raise UserError(f"eval_generate needs one global model; algorithm={run.algorithm} keeps a model per client")
    if data.task == "language" and "dp:" in run.defense:
        raise UserError(
            f"defense={run.defense}: no epsilon holds for {run.dataset}, whose targets (the text shifted by one "
            f"token) reach the server in the clear; clip, noise and nopeek still apply, without a guarantee"
        )


def _own_data_plan(config: ResolvedConfig, device: torch.device) -> HorizontalPlan:
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
    refuse(run, refusals, "data=own;")
    algorithm_class = config.algorithm_class
    if len(algorithm_class.data_owners([np.arange(0)] * int(run.clients))) != run.clients:
        raise UserError(f"algorithm={run.algorithm} pools the clients' samples in one node; data=own keeps them apart")
    data = load_split(run.dataset, "test", run.data_dir)
    blueprint = make_blueprint(config, data, device, init_state(config))
    _check_cut(blueprint, algorithm_class)
    return HorizontalPlan(config, data, None, None, None, blueprint)
