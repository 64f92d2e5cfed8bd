"""The driver's build of a vertical run (`setting=vertical`): its parties in this process, over a
network or on Ray actors, aligned by private set intersection, then the algorithm. What every
process holding a vertical run's roles builds alike (the plan, the blueprint, a party, the
server) is splitlab.vertical, below this and below splitlab.ray_backend, which builds them on its
actors."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from splitlab.algorithms.base import ClientInfo, Context
from splitlab.algorithms.vertical_sl import (
    LABELS_AT_SERVER,
    FeatureParty,
    VerticalAssembler,
    VerticalServer,
    VerticalSplitNN,
)
from splitlab.assembly import Experiment, Roles
from splitlab.config import ResolvedConfig
from splitlab.data.partition import counts_report
from splitlab.errors import UserError
from splitlab.ledger import Ledger
from splitlab.privacy import keys
from splitlab.roles import SyncServer
from splitlab.transport import TRANSPORTS, Transport
from splitlab.vertical import (
    VerticalPlan,
    local_party,
    party_class,
    party_holding,
    party_rows,
    plan_vertical,
    server_holding,
    vertical_server,
)

#: algorithm -> its meaning in the vertical setting (the others have none here yet)


def build_vertical(config: ResolvedConfig, transport: Callable[[Ledger, torch.device], Transport] | None = None) -> Any:
    """The vertical run's experiment: parties (here, over the network: one process each, or on
    Ray actors), server, transport, algorithm; the parties' samples aligned by private set
    intersection (counted in the ledger) before anything is returned."""
    vertical = plan_vertical(config)
    run, data, plan, blueprint = config.run, vertical.data, vertical.plan, vertical.blueprint
    device = blueprint.device
    ledger = Ledger(run.ledger)
    parties: list[FeatureParty] = []
    server: Any
    transport_: Transport
    if run.record and (transport is not None or run.backend == "ray"):
        raise UserError(
            f"record={run.record} needs the parties in this process (`splitlab run`, backend=local): it keeps "
            f"each party's inputs for scoring, which a party in another process never sends"
        )
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
    sync: SyncServer = SyncServer(blueprint)
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
        common, truth = _aligned(algorithm, proxies[0], vertical)
    except BaseException:  # the actors of backend=ray stopped, not left holding the parties
        transport_.close()
        raise
    context.clients = [ClientInfo(j, common) for j in range(plan.parties)]
    transport_.on_rejoin = algorithm.rejoined
    if blueprint.defense.random:  # the noise key of the parties played here (splitlab.privacy.keys)
        transport_.install_noise_secret(blueprint, keys.for_run(run.noise_key))
    # no sample here: the parties and the server evaluate among themselves (VerticalSplitNN.role_metrics)
    none = dict(train_x=data.train_x[:0], train_y=data.train_y[:0], test_x=data.test_x[:0], test_y=data.test_y[:0])
    test = dataclasses.replace(data, **none, prepare=None)
    return Experiment(
        config,
        test,
        context.clients,
        algorithm,
        _report(vertical, truth),
        None if run.backend == "ray" else Roles(list(parties), server, sync),
        blueprint,
        transport_,
        _assembler=VerticalAssembler(blueprint, plan),  # type: ignore[arg-type]
    )


def _aligned(algorithm: VerticalSplitNN, first: Any, vertical: VerticalPlan) -> tuple[int, np.ndarray]:
    """The parties aligned by private set intersection: how many samples they have in common (as
    the first party reports) and their ids (as the dataset says); UserError if none, or if they differ."""
    algorithm.align()
    common = first.sample_count()
    if common == 0:
        raise UserError(
            "the parties have no sample in common (their private set intersection is empty); "
            "check that their id columns name the same samples"
        )
    truth = _common_ids(vertical)
    if common != len(truth):  # only a party that lies can make them differ (tested: PSI finds the truth)
        raise UserError(f"party 0 holds {common} samples after alignment; the parties have {len(truth)} in common")
    return common, truth


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
