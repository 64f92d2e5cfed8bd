"""The driver's build of a vertical run (`setting=vertical`): its parties in this process, over a
network or on Ray actors, aligned by private set intersection, then the algorithm. What every
process holding a vertical run's roles builds alike (the plan, the blueprint, a party, the
server) is splitlab.vertical, below this and below splitlab.ray_backend, which builds them on its
actors."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from splitlab.algorithms.base import ClientInfo, Context
from splitlab.algorithms.vertical_sl import (
    LABELS_AT_SERVER,
    FeatureParty,
    FeaturePlan,
    VerticalAssembler,
    VerticalServer,
    VerticalSplitNN,
)
from splitlab.assembly import Experiment, Roles, resolve_device
from splitlab.config import ResolvedConfig
from splitlab.data import Dataset
from splitlab.data.partition import counts_report
from splitlab.errors import UserError
from splitlab.ledger import Ledger
from splitlab.privacy import keys
from splitlab.roles import Blueprint, SyncServer
from splitlab.transport import TRANSPORTS, Transport
from splitlab.vertical import (
    OwnPlan,
    VerticalPlan,
    check_own_server,
    local_party,
    party_class,
    party_holding,
    party_rows,
    plan_own_server,
    plan_vertical,
    server_holding,
    vertical_server,
)

#: algorithm -> its meaning in the vertical setting (the others have none here yet)


def build_vertical(config: ResolvedConfig, transport: Callable[[Ledger, torch.device], Transport] | None = None) -> Any:
    """The vertical run's experiment: parties (here, over the network: one process each, or on
    Ray actors), server, transport, algorithm; the parties' samples aligned by private set
    intersection (counted in the ledger) before anything is returned."""
    run = config.run
    ledger = Ledger(run.ledger)
    if run.record and (transport is not None or run.backend == "ray"):
        raise UserError(
            f"record={run.record} needs the parties in this process (`splitlab run`, backend=local): it keeps "
            f"each party's inputs for scoring, which a party in another process never sends"
        )
    if run.data == "own":
        return _build_own(config, transport, ledger)
    vertical = plan_vertical(config)
    data, plan, blueprint = vertical.data, vertical.plan, vertical.blueprint
    device = blueprint.device
    parties: list[FeatureParty] = []
    server: Any
    transport_: Transport
    if run.backend == "ray":  # every party's node on a Ray actor, the server on its own
        transport_, proxies, server = _on_ray(config, vertical, ledger)
    else:
        server = vertical_server(blueprint, plan, server_holding(vertical))
        transport_ = (transport or TRANSPORTS[run.transport])(ledger, device)
        if transport_.remote:  # each party in its own process, which must report the rows it holds
            held = [len(party_rows(vertical, j)) for j in range(plan.parties)]
            proxies = transport_.connect_remote(
                {j: party_class(plan, j) for j in range(plan.parties)},
                blueprint,
                {j: {"samples": held[j]} for j in range(plan.parties)},
            )
        else:
            parties = [local_party(vertical, j) for j in range(plan.parties)]
            proxies = {party.id: transport_.connect(party, counted=True) for party in parties}
    # no sample here: the parties and the server evaluate among themselves (VerticalSplitNN.role_metrics)
    none = dict(train_x=data.train_x[:0], train_y=data.train_y[:0], test_x=data.test_x[:0], test_y=data.test_y[:0])
    test = dataclasses.replace(data, **none, prepare=None)
    roles = None if run.backend == "ray" else Roles(list(parties), server, SyncServer(blueprint))
    return _experiment(config, test, plan, blueprint, transport_, proxies, server, roles, vertical)


def _build_own(
    config: ResolvedConfig, transport: Callable[[Ledger, torch.device], Transport] | None, ledger: Ledger
) -> Any:
    """A vertical run whose parties bring their own files (data=own): the server plans it from
    their reports (splitlab.vertical.plan_own_server) and never reads a feature."""
    run = config.run
    transport_ = None if transport is None else transport(ledger, resolve_device(run.device))
    if transport_ is None or not transport_.remote:
        plan_vertical(config)  # refuses data=own in one line, saying how to run it
    assert transport_ is not None
    try:
        check_own_server(run)
        reports = transport_.reported_parties(run.parties)
        own = plan_own_server(config, reports)
    except BaseException:  # the parties told the run is over, not left waiting for it
        transport_.close()
        raise
    plan, blueprint = own.plan, own.blueprint
    server = vertical_server(blueprint, plan, own.server)
    proxies = transport_.connect_remote({j: party_class(plan, j) for j in range(plan.parties)}, blueprint, reports)
    return _experiment(
        config, own.data, plan, blueprint, transport_, proxies, server, Roles([], server, SyncServer(blueprint)), own
    )


def _experiment(
    config: ResolvedConfig,
    test: Dataset,
    plan: FeaturePlan,
    blueprint: Blueprint,
    transport_: Transport,
    proxies: dict[int, Any],
    server: Any,
    roles: Roles | None,
    planned: VerticalPlan | OwnPlan,
) -> Experiment:
    """The algorithm on the roles built, its parties aligned (the run stops if they hold no
    sample in common), and the experiment the engine runs."""
    run = config.run
    sync = roles.sync if roles is not None else SyncServer(blueprint)
    context = Context(
        run,
        config.params,
        [ClientInfo(j, 0) for j in range(plan.parties)],
        proxies,
        transport_.connect(server, counted=False),
        transport_.connect(sync, counted=False),
        drop_client=transport_.drop if transport_.remote else None,
    )
    algorithm = VerticalSplitNN(context)
    try:
        common, report = _aligned(algorithm, proxies[0], planned)
        if isinstance(planned, OwnPlan):
            _as_when_begun(config, report)
    except BaseException:  # the actors of backend=ray stopped, not left holding the parties
        transport_.close()
        raise
    context.clients = [ClientInfo(j, common) for j in range(plan.parties)]
    transport_.on_rejoin = algorithm.rejoined
    if blueprint.defense.random:  # the noise key of the parties played here (splitlab.privacy.keys)
        transport_.install_noise_secret(blueprint, keys.for_run(run.noise_key))
    return Experiment(
        config,
        test,
        context.clients,
        algorithm,
        report,
        roles,
        blueprint,
        transport_,
        _assembler=VerticalAssembler(blueprint, plan),  # type: ignore[arg-type]
    )


def _aligned(algorithm: VerticalSplitNN, first: Any, planned: VerticalPlan | OwnPlan) -> tuple[int, dict[str, Any]]:
    """The parties aligned by private set intersection: how many samples they have in common (as
    the first party reports), and the run's partition.json; UserError if none, or if that differs
    from the dataset's ids (when the server has read them all: not with data=own)."""
    algorithm.align()
    common = first.sample_count()
    if common == 0:
        raise UserError(
            "the parties have no sample in common (their private set intersection is empty); "
            "check that their id columns name the same samples"
        )
    if isinstance(planned, OwnPlan):
        return common, _own_report(planned, common)
    truth = _common_ids(planned)
    if common != len(truth):  # only a party that lies can make them differ (tested: PSI finds the truth)
        raise UserError(f"party 0 holds {common} samples after alignment; the parties have {len(truth)} in common")
    return common, _report(planned, truth)


def _as_when_begun(config: ResolvedConfig, report: dict[str, Any]) -> None:
    """A resumed run of the parties' own files goes on only with the files it began with: their
    columns, rows and common rows as in its partition.json (UserError otherwise), as a client of
    a horizontal data=own run must report its class counts again (splitlab.build)."""
    path = config.out_dir / "partition.json"
    if not config.run.resume or not path.exists():
        return
    try:
        stored = json.loads(path.read_text())
    except (ValueError, OSError) as error:
        raise UserError(f"cannot resume: {str(path)!r} is unreadable ({error})") from None
    for key, value in report.items():
        if not isinstance(stored, dict) or stored.get(key) != value:
            began = stored.get(key) if isinstance(stored, dict) else None
            raise UserError(
                f"cannot resume: the parties' files give {key} {value}, not {began} as when the run began "
                f"({str(path)!r}); resume with the files it began with, or start anew without resume=true"
            )


def _on_ray(config: ResolvedConfig, vertical: VerticalPlan, ledger: Ledger) -> tuple[Transport, dict[int, Any], Any]:
    """backend=ray: the Ray transport, proxies to the parties on their actors, the remote server
    (splitlab.ray_backend.start_parties: each actor gets only what its roles hold)."""
    from splitlab import ray_backend

    plan, blueprint = vertical.plan, vertical.blueprint
    transport = ray_backend.RayTransport(ledger, blueprint.device, config.run.workers)
    parties, server = ray_backend.start_parties(
        config,
        {j: (party_class(plan, j), party_holding(vertical, j)) for j in range(plan.parties)},
        (VerticalServer, server_holding(vertical)),
        vertical.data.prepare,
        blueprint,
        transport,
    )
    return transport, {j: transport.connect(role, counted=True) for j, role in parties.items()}, server


def _common_ids(vertical: VerticalPlan) -> np.ndarray:
    """The ids every holder (each party, and the server when it holds the labels) holds: what the
    parties' private set intersection finds. The server reads them from the dataset, as it reads
    the test set; the parties never send it their ids."""
    holders = [vertical.held(j) for j in range(vertical.plan.parties)]
    if vertical.plan.labels_at == LABELS_AT_SERVER:
        holders.append(vertical.pool[vertical.labelled[vertical.pool]])
    return functools.reduce(np.intersect1d, [vertical.ids[rows] for rows in holders])


def _own_report(own: OwnPlan, common: int) -> dict[str, Any]:
    """partition.json of a vertical run with the parties' own files: as `_report`, without the
    class counts (the server sees the labels only with labels_at=server)."""
    return {"setting": "vertical", "features": own.features, "held_before_alignment": own.held, "aligned": common}


def _report(vertical: VerticalPlan, common: np.ndarray) -> dict[str, Any]:
    """partition.json of a vertical run: the aligned samples' class counts (every party holds the
    same samples), each party's columns and how many samples it held before alignment."""
    rows = np.flatnonzero(np.isin(vertical.ids, common))
    labels = vertical.data.train_y.numpy()[rows]
    counts = np.bincount(labels[labels >= 0], minlength=vertical.blueprint.num_classes).tolist()
    plan = vertical.plan
    return {
        **counts_report([counts] * plan.parties, vertical.blueprint.num_classes),
        "setting": "vertical",
        "features": [list(group) for group in plan.groups],
        "held_before_alignment": [len(vertical.held(j)) for j in range(plan.parties)],
        "aligned": len(common),
    }
