"""The vertical setting (`setting=vertical`): parties holding different features of shared
samples, aligned by private set intersection, trained by vertical SplitNN
(splitlab.algorithms.vertical_sl). The engine's loop, evaluation, ledger and checkpoints are the
same as for any run; only what the roles hold differs. A party's node is built from what it
holds (`Holding`) alike in this process, in its own (`splitlab client`) or on a Ray actor; with
the parties' own files (data=own) the server plans the run from their reports.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitlab.algorithms.base import Algorithm, ClientInfo
from splitlab.algorithms.vertical_sl import (
    LABELS_AT_SERVER,
    FeatureParty,
    FeaturePlan,
    LabelParty,
    VerticalAssembler,
    VerticalModel,
    VerticalServer,
    VerticalSplitNN,
    parse_features,
    top_model,
    vertical_models,
)
from splitlab.assembly import blueprint_of, load_data, resolve_device, seeded_subset, test_set
from splitlab.codec import read_tensors
from splitlab.config import EVAL_GENERATE_WHY, U_SHAPE_WHY, ResolvedConfig, RunConfig
from splitlab.data import Dataset
from splitlab.data.partition import counts_report
from splitlab.data.tables import csv_training_set, own_csv_table, table_ids
from splitlab.errors import UserError, refuse
from splitlab.json_text import file_json
from splitlab.privacy.defenses import check_task, parse_defense
from splitlab.privacy.record import PartyRecorder
from splitlab.roles import Blueprint, ClientNode, Role
from splitlab.run_weights import init_state
from splitlab.settings.base import SERVER, DataShape, Hosted, Plan, Reports, Setting, as_arrays, as_tensors
from splitlab.transport import Proxy, Transport

#: the keys of RunConfig that only a vertical run takes
PARTY_KEYS = ("parties", "features", "labels_at", "combine")
#: algorithm -> its meaning in the vertical setting (the others have none here yet)
VERTICAL_ALGORITHMS = {"sl": VerticalSplitNN}


class Parties(Plan):
    """What every vertical plan has: parties by their columns (`plan`), a server with the top
    model, the parties aligned once connected, the whole model every bottom model then the top."""

    plan: FeaturePlan
    client_test = None  # a vertical run evaluates on the dataset's test set

    @property
    def algorithm_class(self) -> type[Algorithm]:
        return VERTICAL_ALGORITHMS[self.config.run.algorithm]

    @property
    def node_count(self) -> int:
        return self.plan.parties

    def node_class(self, k: int) -> type[ClientNode]:
        return party_class(self.plan, k)

    @property
    def server_class(self) -> type[Role]:
        return VerticalServer

    def clients(self, transport: Transport) -> tuple[list[ClientInfo], dict[str, Any]]:
        return [ClientInfo(j, 0) for j in range(self.plan.parties)], {}

    def align(
        self, algorithm: Algorithm, proxies: dict[int, Proxy], clients: list[ClientInfo], report: dict[str, Any]
    ) -> tuple[list[ClientInfo], dict[str, Any]]:
        """The parties aligned by private set intersection (counted in the ledger): every party
        holds the samples they have in common (UserError if none)."""
        assert isinstance(algorithm, VerticalSplitNN)
        algorithm.align()
        common = proxies[0].sample_count()
        if common == 0:
            raise UserError(
                "the parties have no sample in common (their private set intersection is empty); "
                "check that their id columns name the same samples"
            )
        return [ClientInfo(j, common) for j in range(self.plan.parties)], self.report(common)

    @abc.abstractmethod
    def report(self, common: int) -> dict[str, Any]:
        """partition.json, once `common` samples are aligned."""

    def assembler(self) -> Any:
        return VerticalAssembler(self.blueprint, self.plan)


@dataclasses.dataclass
class VerticalPlan(Parties):
    """A vertical run whose table this process reads: every party's columns, the labels, the ids."""

    config: ResolvedConfig
    data: Dataset  # every training row (a CSV's missing cells NaN), and the test set
    plan: FeaturePlan
    blueprint: Blueprint
    ids: np.ndarray  # every training row's sample id
    labelled: np.ndarray  # rows whose label is known
    missing: np.ndarray  # rows x columns: cells missing (tables only; images: no columns)
    pool: np.ndarray  # the rows in play (train_subset's seeded choice, or all)
    test: np.ndarray  # the test samples every evaluation uses (test_subset's seeded choice, or all)

    def held(self, party: int) -> np.ndarray:
        """The rows party `party` holds: those with all of its columns (and, the label holder, a label)."""
        rows = self.pool
        if self.missing.shape[1]:
            rows = rows[~self.missing[np.ix_(rows, np.asarray(self.plan.groups[party]))].any(axis=1)]
        if self.plan.labels_at == party:
            rows = rows[self.labelled[rows]]
        return rows

    def node(self, k: int) -> ClientNode:
        return local_party(self, k)

    def server(self, remote: bool) -> Role:
        return vertical_server(self.blueprint, self.plan, server_holding(self))

    def expected_reports(self) -> dict[int, dict[str, Any] | None]:
        """Each party in its own process must report the rows it holds."""
        return {j: {"samples": len(party_rows(self, j))} for j in range(self.plan.parties)}

    def actor_loads(self, placed: list[list[int]]) -> list[Any]:
        """Each worker gets only what its parties hold (their columns of their rows, not the dataset)."""
        return [
            {"prepare": self.data.prepare, "roles": {j: as_arrays(vars(party_holding(self, j))) for j in js}}
            for js in placed
        ]

    def server_load(self) -> Any:
        """The top model's actor gets the labels unless a party holds them."""
        return as_arrays(vars(server_holding(self)))

    def test_data(self) -> Dataset:
        """No sample: the parties and the server evaluate among themselves (VerticalSplitNN.role_metrics)."""
        data = self.data
        none = dict(train_x=data.train_x[:0], train_y=data.train_y[:0], test_x=data.test_x[:0], test_y=data.test_y[:0])
        return dataclasses.replace(data, **none, prepare=None)

    def report(self, common: int) -> dict[str, Any]:
        """partition.json: the aligned samples' class counts (every party holds the same samples),
        each party's columns and how many samples it held before alignment; UserError if the
        parties aligned other than the dataset's ids say (only a party that lies makes them
        differ; tested: PSI finds the truth)."""
        truth = self.common_ids()
        if common != len(truth):
            raise UserError(f"party 0 holds {common} samples after alignment; the parties have {len(truth)} in common")
        rows = np.flatnonzero(np.isin(self.ids, truth))
        labels = self.data.train_y.numpy()[rows]
        counts = np.bincount(labels[labels >= 0], minlength=self.blueprint.num_classes).tolist()
        plan = self.plan
        return {
            **counts_report([counts] * plan.parties, self.blueprint.num_classes),
            "setting": "vertical",
            "features": [list(group) for group in plan.groups],
            "held_before_alignment": [len(self.held(j)) for j in range(plan.parties)],
            "aligned": len(truth),
        }

    def common_ids(self) -> np.ndarray:
        """The ids every holder (each party, and the server when it holds the labels) holds: what
        the parties' private set intersection finds. The server reads them from the dataset, as it
        reads the test set; the parties never send it their ids."""
        holders = [self.held(j) for j in range(self.plan.parties)]
        if self.plan.labels_at == LABELS_AT_SERVER:
            holders.append(self.pool[self.labelled[self.pool]])
        return functools.reduce(np.intersect1d, [self.ids[rows] for rows in holders])


def _refusals(run: RunConfig) -> None:
    if run.precision == "fp16":
        raise UserError(
            "precision=fp16 does not apply here: setting=vertical: its parties and top model step through verbs of "
            "their own, not built for it; precision=bf16 needs no loss scaling"
        )
    if parse_defense(run.defense).label_dp is not None and run.labels_at == LABELS_AT_SERVER:
        raise UserError(
            f"defense={run.defense}: label_dp randomises the labels a party sends; with labels_at=server they never "
            "leave the server: give labels_at=<the party holding them>, or leave label_dp out"
        )
    checks = {
        "algorithm": (
            run.algorithm not in VERTICAL_ALGORITHMS,
            "vertical SplitNN is algorithm=sl; others have no vertical form here",
        ),
        "test_split": (run.test_split != "global", "a vertical run evaluates on the dataset's test set"),
        "participation": (run.participation != 1, "every party takes part in every step"),
        "clients": (run.clients != RunConfig.model_fields["clients"].default, "parties= says how many hold features"),
        "lora": (
            run.lora is not None,
            "LoRA fine-tunes a pretrained language model (init=); a vertical run's tables and images train "
            "their bottom and top models from scratch",
        ),
    }
    refuse(run, checks, "setting=vertical:")
    if run.data == "own":
        _own_data_refusals(run)


def _own_data_refusals(run: RunConfig) -> None:
    """What a vertical run whose parties bring their own files (data=own) cannot do."""
    checks = {
        "dataset": (run.dataset != "csv", "each party's own file is a CSV table of its columns (dataset=csv)"),
        "features": (run.features is not None, "each party's file holds its columns; the parties report how many"),
        "train_subset": (run.train_subset is not None, "each party uses every row of its own file"),
        "backend": (run.backend != "local", "the parties are `splitlab client` processes with their own files"),
    }
    refuse(run, checks, "setting=vertical data=own:")


def plan_vertical(config: ResolvedConfig) -> VerticalPlan:
    """Validate a vertical run and derive its data, feature groups and blueprint; UserError on bad input."""
    run = config.run
    _refusals(run)
    if run.data == "own":
        raise UserError(
            "setting=vertical data=own: no process holds every party's columns; run the server with "
            "`splitlab server` and each party with `splitlab client data=own data_dir=DIR` (docs/deployment.md)"
        )
    data = load_data(config)
    data_dir = None if run.data_dir is None else Path(run.data_dir)
    if data.task != "classification":
        raise UserError(f"setting=vertical divides a sample's features; {run.dataset}'s sequences are not split so")
    if run.dataset == "csv":
        data = csv_training_set(data_dir)
    check_task(parse_defense(run.defense), run.defense, run.dataset, data.task, data.num_classes)
    if run.labels_at != LABELS_AT_SERVER and not 0 <= int(run.labels_at) < run.parties:
        raise UserError(f"labels_at={run.labels_at} is not a party; allowed: server or 0 to {run.parties - 1}")
    dtype = data.inputs(data.train_x[:1]).dtype
    shape = (data.input_shape, data.num_classes, dtype, data.task)
    plan, blueprint = vertical_blueprint(config, resolve_device(run.device), shape)
    blueprint.new_model().client_stage_count(run.cut)  # a cut outside the model: one line
    top_model(blueprint, plan)  # embeddings the combination cannot join: one line
    ids, labelled, missing = table_ids(run.dataset, data_dir, data)
    pool = np.sort(seeded_subset(len(ids), run.train_subset, run.seed, "train_subset"))
    test = seeded_subset(len(data.test_y), run.test_subset, run.seed, "test_subset")  # as assembly.test_set's
    return VerticalPlan(config, data, plan, blueprint, ids, labelled, missing, pool, test)


def vertical_blueprint(
    config: ResolvedConfig,
    device: torch.device,
    shape: DataShape,
    groups: tuple[tuple[int, ...], ...] | None = None,
) -> tuple[FeaturePlan, Blueprint]:
    """The run's feature groups (`features=`'s, unless given) and blueprint from what they need of
    the data (`shape`): a Ray actor holding parties or the top model gets these from the driver
    (splitlab.ray_backend)."""
    run = config.run
    input_shape, num_classes, input_dtype, task = shape
    if groups is None:
        groups = parse_features(run.features, input_shape[-1], run.parties)
    plan = FeaturePlan(input_shape, groups, run.combine, run.labels_at)
    recorder = PartyRecorder(run.record) if run.record else None
    blueprint = blueprint_of(
        config, device, input_shape, num_classes, input_dtype, task, init_state(config), vertical_models(plan), recorder
    )
    return plan, blueprint


@dataclasses.dataclass
class Holding:
    """What one role of a vertical run holds before alignment, wherever it is built: sample ids
    (sorted), their labels (the label holder's; else empty or None) and a party's columns of those
    samples (the server: None); for the joint evaluation, how many test samples there are, a
    party's columns of them (stored form, the test split's order) and the label holder's labels
    of them (else None)."""

    ids: np.ndarray
    labels: torch.Tensor | None
    x: torch.Tensor | None = None
    test_samples: int = 0
    test_x: torch.Tensor | None = None
    test_y: torch.Tensor | None = None


def party_holding(vertical: VerticalPlan, party: int) -> Holding:
    """Party `party`'s columns of the rows it holds, in id order, and of the test samples; the
    label holder's labels of both."""
    data, plan, test = vertical.data, vertical.plan, torch.as_tensor(vertical.test)
    rows = party_rows(vertical, party)
    x = plan.columns(data.train_x[torch.as_tensor(rows)], party).contiguous()
    labels = data.train_y[torch.as_tensor(rows)] if plan.labels_at == party else None
    test_x = plan.columns(data.test_x[test], party).contiguous()
    test_y = data.test_y[test] if plan.labels_at == party else None
    return Holding(vertical.ids[rows], labels, x, len(test), test_x, test_y)


def server_holding(vertical: VerticalPlan) -> Holding:
    """The server's labels and their ids, in id order, and the test samples' labels (none unless
    `labels_at=server`); never a feature."""
    pool, labelled, data = vertical.pool, vertical.labelled, vertical.data
    at_server = vertical.plan.labels_at == LABELS_AT_SERVER
    rows = pool[labelled[pool]] if at_server else pool[:0]
    rows = rows[np.argsort(vertical.ids[rows], kind="stable")]
    test_y = data.test_y[torch.as_tensor(vertical.test)] if at_server else None
    return Holding(
        vertical.ids[rows], data.train_y[torch.as_tensor(rows)], test_samples=len(vertical.test), test_y=test_y
    )


def feature_party(blueprint: Blueprint, plan: FeaturePlan, party: int, held: Holding, prepare: Any) -> FeatureParty:
    """Party `party`'s node before alignment, holding `held` (in this process, another, or a Ray actor)."""
    assert held.x is not None and held.test_x is not None, "a party holds columns"
    device = blueprint.device
    return party_class(plan, party)(
        blueprint,
        party,
        held.ids,
        held.x.to(device),
        prepare,
        None if held.labels is None else held.labels.to(device),
        held.test_x.to(device),
        None if held.test_y is None else held.test_y.to(device),
    )


def vertical_server(blueprint: Blueprint, plan: FeaturePlan, held: Holding) -> VerticalServer:
    """The server's role holding `held` (in this process or a Ray actor)."""
    assert held.labels is not None, "the server holds labels, perhaps none"
    device = blueprint.device
    test_y = None if held.test_y is None else held.test_y.to(device)
    return VerticalServer(blueprint, plan, held.ids, held.labels.to(device), held.test_samples, test_y)


def local_party(vertical: VerticalPlan, party: int) -> FeatureParty:
    """Party `party`'s node from the run's data (in process, or a `splitlab client`'s own)."""
    return feature_party(
        vertical.blueprint, vertical.plan, party, party_holding(vertical, party), vertical.data.prepare
    )


def party_rows(vertical: VerticalPlan, party: int) -> np.ndarray:
    """The rows party `party` holds, in id order; UserError if none."""
    rows = vertical.held(party)
    if len(rows) == 0:
        raise UserError(f"party {party} holds no sample with all of its features {_said(vertical.plan.groups[party])}")
    return rows[np.argsort(vertical.ids[rows], kind="stable")]


def _own_party(config: ResolvedConfig, party: int) -> FeatureParty:
    """Party `party`'s node from its own files (data=own): its columns only, standardised as in
    the whole table, its bottom model built for them as in a run that reads the whole table (the
    weights depend on the seed and the number of columns alone). It reports its columns, its rows,
    its test rows (their ids' digest: every party must hold the same) and, the label holder, the
    number of classes; the server plans the run from those reports."""
    _refusals(config.run)
    run, holds_labels = config.run, config.run.labels_at == party
    data, ids, labelled, test_ids = own_csv_table(Path(str(run.data_dir)), holds_labels, features=True)
    columns = data.input_shape[-1]
    # the other parties' columns are theirs: this party's plan knows its own alone
    groups = tuple(tuple(range(columns)) if j == party else () for j in range(run.parties))
    # a party without labels does not know the classes; the stages before the cut never see them
    classes = data.num_classes if holds_labels else 1
    device = resolve_device(run.device)
    plan, blueprint = vertical_blueprint(config, device, ((columns,), classes, data.train_x.dtype, data.task), groups)
    missing = torch.isnan(data.train_x).numpy()
    test = seeded_subset(len(test_ids), run.test_subset, run.seed, "test_subset")
    vertical = VerticalPlan(config, data, plan, blueprint, ids, labelled, missing, np.arange(len(ids)), test)
    node = local_party(vertical, party)
    node.reported = own_report(columns, test_ids, classes if holds_labels else 0)
    return node


@dataclasses.dataclass
class OwnPlan(Parties):
    """What the server of a vertical run with the parties' own files (data=own) derives from their
    reports (and, `labels_at=server`, its own file of ids and labels): no feature reaches it."""

    config: ResolvedConfig
    plan: FeaturePlan
    blueprint: Blueprint
    holding: Holding  # the server's
    reports: dict[int, dict[str, Any]]  # what each party reported of its files
    data: Dataset  # no sample: the dataset's shape and classes

    def node(self, k: int) -> ClientNode:
        raise AssertionError("data=own: every party is a `splitlab client` with its own files")

    def server(self, remote: bool) -> Role:
        return vertical_server(self.blueprint, self.plan, self.holding)

    def expected_reports(self) -> dict[int, dict[str, Any] | None]:
        return dict(self.reports)

    def test_data(self) -> Dataset:
        return self.data

    def report(self, common: int) -> dict[str, Any]:
        """partition.json: as a `VerticalPlan`'s, without the class counts (the server sees the
        labels only with labels_at=server); a resumed run goes on only with the files it began
        with (`_as_when_begun`)."""
        report = {
            "setting": "vertical",
            "features": [list(group) for group in self.plan.groups],
            "held_before_alignment": [self.reports[j]["samples"] for j in range(self.plan.parties)],
            "aligned": common,
        }
        _as_when_begun(self.config, report)
        return report


def _as_when_begun(config: ResolvedConfig, report: dict[str, Any]) -> None:
    """A resumed run of the parties' own files goes on only with the files it began with: their
    columns, rows and common rows as in its partition.json (UserError otherwise), as a client of
    a horizontal data=own run must report its class counts again (splitlab.settings.horizontal)."""
    path = config.out_dir / "partition.json"
    if not config.run.resume or not path.exists():
        return
    try:
        stored = file_json(path.read_text())
    except (ValueError, OSError) as error:
        raise UserError(f"cannot resume: {str(path)!r} is unreadable ({error})") from None
    for key, value in report.items():
        if not isinstance(stored, dict) or stored.get(key) != value:
            began = stored.get(key) if isinstance(stored, dict) else None
            raise UserError(
                f"cannot resume: the parties' files give {key} {value}, not {began} as when the run began "
                f"({str(path)!r}); resume with the files it began with, or start anew without resume=true"
            )


def check_own_server(run: RunConfig) -> None:
    """What a server of a vertical run with the parties' own files can refuse before they report."""
    _refusals(run)
    if run.labels_at != LABELS_AT_SERVER and not 0 <= int(run.labels_at) < run.parties:
        raise UserError(f"labels_at={run.labels_at} is not a party; allowed: server or 0 to {run.parties - 1}")
    if run.labels_at == LABELS_AT_SERVER and run.data_dir is None:
        raise UserError(
            "setting=vertical data=own labels_at=server: the server reads its ids and labels from data_dir="
        )


def plan_own_server(config: ResolvedConfig, reports: dict[int, dict[str, Any]]) -> OwnPlan:
    """The server's plan from the parties' reports: party j's columns follow party j-1's (their
    order in a table that joins their files), the classes the label holder's (or the server's own
    labels), the test samples those every party holds; UserError if the parties' test rows differ."""
    run = config.run
    check_own_server(run)
    widths = [reports[j]["columns"] for j in range(run.parties)]
    ends = np.cumsum(widths).tolist()
    features = "/".join(f"{end - width}-{end - 1}" for width, end in zip(widths, ends))
    if run.labels_at == LABELS_AT_SERVER:
        labels, ids, labelled, test_ids = own_csv_table(Path(str(run.data_dir)), labels=True, features=False)
        classes = labels.num_classes
        rows = np.flatnonzero(labelled)
        rows = rows[np.argsort(ids[rows], kind="stable")]
        mine: dict[str, Any] | None = own_report(0, test_ids, classes)
    else:
        classes, mine = reports[int(run.labels_at)]["classes"], None
    check_task(parse_defense(run.defense), run.defense, run.dataset, "classification", classes)
    samples = reports[0]["test_samples"]
    for holder, report in [*((f"party {j}", reports[j]) for j in range(run.parties)), ("the server", mine)]:
        if report is not None and report["test_ids"] != reports[0]["test_ids"]:
            raise UserError(
                f"{holder}'s test.csv holds other test samples ({report['test_samples']} rows with every cell) "
                f"than party 0's ({samples}): every holder's test.csv lists the same ids, in the same order"
            )
    test = seeded_subset(samples, run.test_subset, run.seed, "test_subset")
    planned = dataclasses.replace(config, run=run.model_copy(update={"features": features}))
    shape = ((ends[-1],), classes, torch.float32, "classification")
    plan, blueprint = vertical_blueprint(planned, resolve_device(run.device), shape)
    blueprint.new_model().client_stage_count(run.cut)  # a cut outside the model: one line
    top_model(blueprint, plan)  # embeddings the combination cannot join: one line
    if mine is None:
        server = Holding(np.zeros(0, dtype=np.int64), torch.zeros(0, dtype=torch.long), test_samples=len(test))
    else:
        server = Holding(
            ids[rows], labels.train_y[torch.as_tensor(rows)], test_samples=len(test), test_y=labels.test_y[test]
        )
    empty = torch.zeros(0, ends[-1])
    data = Dataset("csv", empty, empty[:, 0].long(), empty, empty[:, 0].long(), classes, (ends[-1],))
    return OwnPlan(config, plan, blueprint, server, reports, data)


def own_report(columns: int, test_ids: np.ndarray, classes: int) -> dict[str, Any]:
    """What a party (or the server, holding the labels) with its own files says of them besides
    its rows: its columns, its test rows and their ids' digest (in order), the classes it knows."""
    digest = hashlib.sha256(np.ascontiguousarray(test_ids, dtype="<i8").tobytes()).hexdigest()
    return {"columns": columns, "test_samples": len(test_ids), "test_ids": digest, "classes": classes}


class Vertical(Setting):
    """Parties holding different features of shared samples."""

    whole_samples = False
    own_keys = {key: f"{key} is for parties; it needs setting=vertical" for key in PARTY_KEYS}
    refused_keys = {
        "eval_generate": EVAL_GENERATE_WHY,
        "tail_cut": U_SHAPE_WHY,
        "grad_accum": "a vertical run's parties step on every batch of shared samples; grad_accum needs "
        "setting=vanilla",
        "clip_scope": "a vertical run's server steps on every party's embeddings at once, not through one client's "
        "split step; clip_scope=global needs setting=vanilla",
    }

    def check(self, config: ResolvedConfig) -> None:
        plan_vertical(config)

    def plan(self, config: ResolvedConfig, elsewhere: bool, reports: Reports) -> Parties:
        run = config.run
        if run.record and (elsewhere or run.backend == "ray"):
            raise UserError(
                f"record={run.record} needs the parties in this process (`splitlab run`, backend=local): it keeps "
                f"each party's inputs for scoring, which a party in another process never sends"
            )
        if run.data != "own" or not elsewhere:
            return plan_vertical(config)  # data=own: refused in one line, saying how to run it
        check_own_server(run)
        return plan_own_server(config, reports(run.parties))

    def node_count(self, config: ResolvedConfig) -> int:
        return config.run.parties

    def releasers(self, run: RunConfig) -> int:
        """Every party releases its own embedding of a sample."""
        return run.parties

    def node_here(self, config: ResolvedConfig, k: int) -> ClientNode:
        """Party `k`'s node, built in its own process: the same rows and initial weights as in
        this process; it aligns them when the server asks."""
        if not 0 <= k < config.run.parties:
            raise UserError(f"client_id={k} is not a party of this run; allowed: 0 to {config.run.parties - 1}")
        if config.run.data == "own":
            return _own_party(config, k)
        return local_party(plan_vertical(config), k)

    def host_nodes(
        self, config: ResolvedConfig, device: torch.device, load: Any, placed: list[int], shape: DataShape
    ) -> Hosted:
        """The parties placed on a Ray actor, each from what it holds, as in the driver's process:
        a party stays on its worker (every party takes part in every step, one after another)."""
        plan, blueprint = vertical_blueprint(config, device, shape)
        roles: dict[int | str, Role] = {
            j: feature_party(blueprint, plan, j, _holding_of(load["roles"][j]), load["prepare"]) for j in placed
        }
        return Hosted(blueprint, roles)

    def host_server(self, config: ResolvedConfig, device: torch.device, load: Any, shape: DataShape) -> Hosted:
        plan, blueprint = vertical_blueprint(config, device, shape)
        return Hosted(blueprint, {SERVER: vertical_server(blueprint, plan, _holding_of(load))})


def _holding_of(fields: dict[str, Any]) -> Holding:
    """The `Holding` a Ray actor got (`as_arrays`), labels and columns as tensors over the object store's memory."""
    return Holding(**{**as_tensors(fields), "ids": fields["ids"]})


def party_class(plan: FeaturePlan, party: int) -> type[FeatureParty]:
    return LabelParty if plan.labels_at == party else FeatureParty


def _said(group: tuple[int, ...]) -> str:
    return f"(columns {group[0]}-{group[-1]})" if group == tuple(range(group[0], group[-1] + 1)) else f"{list(group)}"


def load_final(path: Path, stored: dict[str, Any], device: str) -> tuple[ResolvedConfig, VerticalPlan, VerticalModel]:
    """A finished vertical run's config, plan and final model (weights.safetensors: every bottom
    model, then the top), in this process, for `splitlab evaluate` and `splitlab attack`."""
    from splitlab.resolve import resolve_config

    config = resolve_config({**stored, "device": device, "out": str(path), "backend": "local"})
    vertical = plan_vertical(config)
    model = VerticalAssembler(vertical.blueprint, vertical.plan).model
    weights = read_tensors(path / "weights.safetensors", vertical.blueprint.device)
    try:
        model.load_state_dict(weights)
    except (RuntimeError, KeyError) as error:
        raise UserError(
            f"cannot read {str(path / 'weights.safetensors')!r}: {str(error).splitlines()[0][:160]}"
        ) from None
    return config, vertical, model


def evaluate_vertical(path: Path, stored: dict[str, Any], device: str) -> dict[str, float]:
    """A finished vertical run's final model on its test set, computed as the run computed its
    final metrics (every party's features of each test sample, combined, through the top model)."""
    from splitlab.metrics import TASK_METRICS

    config, vertical, model = load_final(path, stored, device)
    x, y = test_set(config, vertical.data, vertical.blueprint.device)
    return TASK_METRICS[vertical.data.task](vertical.blueprint.logits(model, x), y)
