"""Building a run: its setting's plan (splitlab.settings), placed in this process, on Ray actors
or over the network, then the algorithm.

`build(config)` validates everything and builds the whole experiment before the engine writes a
byte, so a bad setting never leaves a half-made run directory; `check` does the same checks
without building the roles, for a sweep to check all its runs first. A networked client builds
its own node with `client_node`, from the same plan as the server's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from splitlab import ray_backend, rundir
from splitlab.algorithms.base import Context
from splitlab.assembly import Experiment, Roles, resolve_device
from splitlab.config import ResolvedConfig
from splitlab.errors import UserError
from splitlab.ledger import Ledger
from splitlab.loggers import check_logger
from splitlab.privacy import keys
from splitlab.resolve import resolve_config
from splitlab.roles import ClientNode
from splitlab.settings import Plan, Setting, check_keys
from splitlab.transport import TRANSPORTS, Proxy, Transport
from splitlab.vectorized import Together


def resolved(raw: Mapping[str, Any]) -> tuple[ResolvedConfig, Setting]:
    """The run's config resolved (splitlab.resolve) and its setting, which refuses the keys it
    does not take (splitlab.settings.check_keys)."""
    config = resolve_config(raw)
    return config, check_keys(config)


def client_node(raw: Mapping[str, Any], client_id: int) -> ClientNode:
    """Node `client_id` of the run `raw` configures, built in this process (a networked client):
    the same samples, batches and initial weights as the node `build` would make. With data=own,
    its samples are those in `data_dir` (the client's own)."""
    config, setting = resolved(raw)
    return setting.node_here(config, client_id)


def client_count(raw: Mapping[str, Any]) -> int:
    """How many nodes the run `raw` configures (the partition's clients; centralized: one;
    vertical: the parties)."""
    config, setting = resolved(raw)
    return setting.node_count(config)


def check(raw: Mapping[str, Any]) -> None:
    """Everything about a run that can be checked without building its roles (settings, out,
    logger, device, dataset, partition, cut, subsets): UserError if `build` would refuse it. A
    sweep checks all its runs so before the first one starts."""
    config, setting = resolved(raw)
    rundir.check_out_dir(config.out_dir)
    check_logger(config.run.logger)
    setting.check(config)


def build(
    raw: Mapping[str, Any],
    transport: Callable[[Ledger, torch.device], Transport] | None = None,
    spare: Sequence[Any] = (),
) -> Experiment:
    """Validate the config, plan the run by its setting and place the plan: its nodes here, in
    Ray actors (backend=ray) or in other processes (`transport` with `remote` nodes: a network,
    whose nodes report what they hold); then the algorithm, and the nodes aligned if the setting
    aligns them. `spare`: the actors of the run's previous attempt still alive (Transport.hand_over),
    rebuilt and used before new ones are started; stopped if the build fails. UserError on bad input."""
    config, setting = resolved(raw)
    run = config.run
    rundir.check_out_dir(config.out_dir)
    if run.resume and not run.overwrite:
        rundir.check_resume_target(config.out_dir)
    check_logger(run.logger)
    if transport is not None and run.backend == "ray":
        raise UserError("backend=ray runs clients on Ray actors; a networked server takes backend=local")
    ledger, device = Ledger(run.ledger), resolve_device(run.device)
    made: list[Transport] = []  # made once needed: a plan refused first makes none

    def transport_() -> Transport:
        if not made:
            make = transport or TRANSPORTS[run.transport]
            ray = run.backend == "ray"
            made.append(ray_backend.RayTransport(ledger, device, run.workers, spare) if ray else make(ledger, device))
        return made[0]

    def reports(nodes: int) -> dict[int, dict[str, Any]]:
        return transport_().reports_to_plan(nodes)

    try:
        if spare:  # held by the transport from now on: stopped with it if the build fails
            transport_()
        plan = setting.plan(config, transport is not None, reports)
        return _placed(config, plan, transport_())
    except BaseException:  # the actors stopped, the networked nodes told the run is over
        for placed in made:
            placed.close()
        raise


def _placed(config: ResolvedConfig, plan: Plan, transport: Transport) -> Experiment:
    """The plan's nodes and server placed where `transport` reaches them, the algorithm on them,
    the nodes aligned."""
    run = config.run
    blueprint = plan.blueprint
    sync = plan.sync()
    nodes: list[ClientNode] = []
    proxies: dict[int, Proxy]
    server: Any
    if isinstance(transport, ray_backend.RayTransport):
        remote_nodes, server = ray_backend.start_roles(plan, transport)
        proxies = {k: transport.connect(role, counted=True) for k, role in remote_nodes.items()}
        roles = None
    else:
        if transport.remote:  # each node must report the data it holds
            classes = {k: plan.node_class(k) for k in range(plan.node_count)}
            proxies = transport.connect_remote(classes, blueprint, plan.expected_reports())
        else:
            nodes = [plan.node(k) for k in range(plan.node_count)]
            proxies = {node.id: transport.connect(node, counted=True) for node in nodes}
        server = plan.server(transport.remote)
        roles = Roles(nodes, server, sync)
    clients, report = plan.clients(transport)
    context = Context(
        run,
        config.params,
        clients,
        proxies,
        transport.connect(server, counted=False),
        transport.connect(sync, counted=False),
        transport.concurrency,
        transport.drop if transport.remote else None,
        transport.lease,
        Together(blueprint, nodes, transport.ledger) if run.vectorize else None,
    )
    algorithm = plan.algorithm_class(context)
    context.clients, report = plan.align(algorithm, proxies, clients, report)
    transport.on_rejoin = algorithm.rejoined
    if blueprint.defense.random:  # each party's own noise key (splitlab.privacy.keys)
        transport.install_noise_secret(blueprint, keys.for_run(run.noise_key))
    return Experiment(
        config,
        plan.test_data(),
        context.clients,
        algorithm,
        report,
        roles,
        blueprint,
        transport,
        plan.client_test,
        plan.assembler(),
    )
