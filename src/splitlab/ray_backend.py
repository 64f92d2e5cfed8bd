"""backend=ray: client nodes on a pool of long-lived Ray actors, the training server on its own.

The dataset goes into Ray's object store once (each node gets one copy, which the actors there
map without copying): a node without the data files runs clients, and the training server's
actor, which holds no samples, is built from the data's shape alone. Each of the `workers` actors
starts with the clients k with k mod workers = w, built in the actor from the run's configuration and the
indices of their samples; a client that trains goes to whichever worker is free
(`RayTransport.lease`), its state (kept models, optimizers, working copies, round) moving from
actor to actor through the object store, never through the driver. The sync server and the
algorithm stay in the driver, with the assembly. Personal models are evaluated on the actors that
hold them (only metrics come back), and a lost actor raises `RoleLost`, on which the engine
builds the roles again and replays from the last checkpoint: in new actors in place of the lost
ones, and in the actors still alive (`RayTransport.hand_over`, `RoleHost.rebuild`), which are not
started again. Every verb call and its result travel as `splitlab.codec` bytes (safetensors +
JSON), as through the serialized transport, so results are bit for bit those of an in-process
run. Ray itself pickles what it carries (here: those bytes, client ids, verb names and the
dataset's arrays), between processes of a cluster the user started and trusts.

What each actor gets and how it builds its roles is the run's setting's (splitlab.settings): a
vertical run puts its parties on the client workers (party j on worker j mod workers, for the
whole run) and its server (the top model, and the labels unless a party holds them) on the
server's actor; each actor gets only what its roles hold.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from splitlab import assembly, cluster, codec
from splitlab.config import ResolvedConfig
from splitlab.errors import NonFiniteStep, RoleLost, UserError
from splitlab.ledger import Ledger
from splitlab.logs import LOGGER
from splitlab.metrics import TASK_METRICS
from splitlab.models import shared_state
from splitlab.plugins import ray_options
from splitlab.process_settings import peak_memory_mib, set_worker_threads, training_device
from splitlab.resolve import resolve_config
from splitlab.roles import Blueprint, ClientNode, State
from splitlab.settings import Plan, setting_of
from splitlab.settings.base import SERVER
from splitlab.transport import Proxy, SerializedTransport, VerbSpec

#: after an actor was lost, how long another has to answer to be rebuilt for the replay (one on a
#: node going away may not answer at all)
HAND_OVER_SECONDS = 10.0


class RoleHost:
    """A Ray actor's roles: the nodes `placed` here (a client worker, built from its `load`), or
    (`placed` None) the training server, from its load and the data's shape (`data_shape`, JSON);
    built by the run's setting (splitlab.settings) from the configuration, as in the driver. A bad
    setting found while building (a device this node lacks) is kept, not raised, for `ready` to
    report with the node's id and hostname."""

    def __init__(self, config_json: str, load: Any, placed: list[int] | None, data_shape: str) -> None:
        self.rebuild(config_json, load, placed, data_shape)

    def rebuild(self, config_json: str, load: Any, placed: list[int] | None, data_shape: str) -> str | None:
        """The roles built afresh from these arguments, as a new actor builds them: also how an actor
        that outlived another's loss takes its part in the run's replay, without a new process.
        Returns what `ready` returns."""
        config = resolve_config(json.loads(config_json))
        set_worker_threads(config.run.cpus_per_client)
        # torch's first optimizer step imports torch._dynamo (1.5 s): here, while the actors start, not
        # as a stall in the first round of every actor
        importlib.import_module("torch._dynamo")
        self.failure: str | None = None
        try:
            self._build(config, load, placed, data_shape)
        except UserError as error:
            self.failure = f"{cluster.this_node()}: {error}"
        except Exception as error:  # the node's libraries or devices (e.g. CUDA): named, not a dead actor
            LOGGER.exception("building the roles failed")  # the traceback, in the actor's log
            reason = (str(error).strip().splitlines() or [""])[0][:200]
            self.failure = f"{cluster.this_node()}: building the roles failed: {type(error).__name__}: {reason}"
        return self.failure

    def _build(self, config: ResolvedConfig, load: Any, placed: list[int] | None, data_shape: str) -> None:
        """The roles, built by the run's setting."""
        device = assigned_device() if config.run.device == "auto" else assembly.resolve_device(config.run.device)
        self.device = device
        setting, shape = setting_of(config), shape_of(data_shape)
        hosted = (
            setting.host_server(config, device, load, shape)
            if placed is None
            else setting.host_nodes(config, device, load, placed, shape)
        )
        self.hosted, self.blueprint, self.roles = hosted, hosted.blueprint, hosted.roles
        self.metrics = TASK_METRICS[self.blueprint.task]
        self.assemble = assembly.Assembler(self.blueprint)

    def ready(self) -> str | None:
        """None once the roles are built; else why they could not be, naming this node."""
        return self.failure

    def set_noise_secret(self, secret: bytes) -> None:
        """The driver's noise secret (splitlab.privacy.keys): it plays these parties too."""
        self.blueprint.noise_secret = secret

    def peak_memory_mib(self) -> float:
        """This actor's peak resident set size (benchmarks/ray_clients.py)."""
        return peak_memory_mib()

    def pop_seconds(self) -> dict[str, float]:
        """The compute seconds by phase of this actor's roles since the last call."""
        return self.blueprint.pop_seconds()

    def call(self, key: int | str, name: str, request: bytes) -> bytes:
        """Role `key`'s verb `name` on the decoded request; the result encoded. Only verbs are called."""
        role = self.roles[key]
        if getattr(getattr(type(role), name, None), "__verb__", None) is None:
            raise AttributeError(f"{type(role).__name__}.{name} is not a verb")
        message = codec.decode(request, self.device)
        return codec.encode(getattr(role, name)(*message["args"], **message["kwargs"]))

    def give_up(self, client_id: int) -> bytes:
        """Client `client_id` leaves this actor for another (`adopt`): what it holds, encoded (its
        kept models and optimizers, the working copies it was given this round, and the round)."""
        node = cast(ClientNode, self.roles.pop(client_id))
        copies = {slot: shared_state(node.models[slot]) for slot in sorted(node.scratch)}
        moving = codec.encode({"state": node.state_dict(), "copies": copies, "round": node.round})
        for slot in copies:
            node.return_copy(slot)
        return moving

    def adopt(self, client_id: int, moving: bytes) -> None:
        """Client `client_id` comes here with what `give_up` encoded, before it trains in its round:
        built afresh from its samples, it gets its state, the round begins, its copies are loaded."""
        assert self.hosted.new_node is not None, "this setting's nodes never move"
        node = self.hosted.new_node(client_id)
        message = codec.decode(moving, self.device)
        node.load_state_dict(message["state"])
        node.begin_round(message["round"])
        for slot, weights in message["copies"].items():
            node.load_copy(slot, weights)
        self.roles[client_id] = node

    def personal_logits(self, request: bytes) -> bytes:
        """test_split=client: the logits of the personal models of the clients the request names (all
        held here) on the samples each holds out, with the server part the request holds (encoded)."""
        message = codec.decode(request, self.device)
        slot, server = message["slot"], message["server"]
        logits = {}
        for k in message["clients"]:
            assert self.hosted.held_out is not None, "test_split=client holds samples out"
            x = self.hosted.held_out(k)
            model = self.assemble([self.roles[k].snapshot(slot), server])
            logits[str(k)] = self.blueprint.logits(model, x)
        return codec.encode(logits)

    def personal_metrics(self, request: bytes) -> str:
        """The test metrics of the personal models here (each client's `slot`, then the server part
        the request holds), as JSON: {"trained": {client id: metrics}, "untrained": metrics}. The
        clients that never trained the slot all hold its initial weights: evaluated once, for all of
        them, so the work and the reply follow the clients that trained, not K."""
        message = codec.decode(request, self.device)
        slot, server = message["slot"], message["server"]
        assert self.hosted.test is not None, "personal models are evaluated where they are"
        x, y = self.hosted.test

        def metrics(client_state: State) -> dict[str, float]:
            return assembly.personal_metrics(self.assemble, [client_state, server], x, y, self.blueprint, self.metrics)

        trained = {str(k): metrics(role.snapshot(slot)) for k, role in self.roles.items() if slot in role.models}
        untrained = metrics(self.blueprint.initial_state(slot)) if len(trained) < len(self.roles) else None
        return json.dumps({"trained": trained, "untrained": untrained})


def data_shape_of(blueprint: Blueprint) -> str:
    """What a role that holds no dataset needs of its shape to make the blueprint (JSON; `shape_of`)."""
    return json.dumps(
        {
            "input_shape": list(blueprint.input_shape),
            "num_classes": blueprint.num_classes,
            "input_dtype": str(blueprint.input_dtype),
            "task": blueprint.task,
        }
    )


def shape_of(data_shape: str) -> tuple[tuple[int, ...], int, torch.dtype, str]:
    """`data_shape_of`'s JSON as `blueprint_of`'s input shape, classes, input dtype and task."""
    shape = json.loads(data_shape)
    dtype = getattr(torch, shape["input_dtype"].removeprefix("torch."))
    return tuple(shape["input_shape"]), shape["num_classes"], dtype, shape["task"]


def assigned_device() -> torch.device:
    """device=auto in an actor: the GPU Ray gave it (gpus_per_client > 0), else the CPU, even on a node
    with GPUs (Ray no longer hides them from actors that asked for none). A GPU Ray gave that torch
    cannot use (GPUs declared to Ray without CUDA, a CPU-only torch) leaves the CPU, as device=auto
    does in process."""
    gave_a_gpu = bool(cluster.ray_module().get_gpu_ids())
    return training_device(torch.device("cuda" if gave_a_gpu and torch.cuda.is_available() else "cpu"))


class RemoteVerb:
    """One verb of a role in a Ray actor: request bytes in, result bytes out (waits for the result),
    sent to the actor that holds the role when called (a client moves between workers)."""

    def __init__(self, role: RemoteRole, name: str) -> None:
        self.role, self.name = role, name

    @property
    def host(self) -> Any:
        return self.role.host

    @property
    def key(self) -> int | str:
        return self.role.key

    def __call__(self, request: bytes) -> bytes:
        return wait_for(self.host.call.remote(self.key, self.name, request), f"{self.key} {self.name}")


def wait_for(pending: Any, what: str) -> Any:
    """ray.get of `pending`; an actor lost on the way (killed, its node gone) raises RoleLost."""
    ray = cluster.ray_module()
    try:
        return ray.get(pending)
    except ray.exceptions.RayActorError as error:
        cause = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
        raise RoleLost(f"a Ray actor was lost during {what} ({type(error).__name__}: {cause})") from None
    except ray.exceptions.RayTaskError as error:  # a diverging server step: exit 3, as in process
        if isinstance(error.cause, NonFiniteStep):
            raise NonFiniteStep(error.cause.what, error.cause.value) from None
        raise


class RemoteRole:
    """A role in a Ray actor, as the driver's proxies reach it: its verbs are `RemoteVerb`s, to the
    actor that holds it now (a client moves between `worker`s; the server's is -1)."""

    def __init__(self, role_class: type, host: Any, key: int | str, worker: int = -1) -> None:
        self.role_class, self.host, self.key, self.worker = role_class, host, key, worker

    def __getattr__(self, name: str) -> RemoteVerb:
        if name.startswith("__"):
            raise AttributeError(name)
        return RemoteVerb(self, name)


class RayTransport(SerializedTransport):
    """Verb calls to roles in Ray actors as codec bytes; to roles in this process (the sync server)
    encoded and decoded here, as by the serialized transport. Safe to call from several threads.

    Clients train on whichever client worker is free (`lease`): their own if it is, else the free
    one that has worked least, to which their state moves. The results do not depend on where a
    client trains, so this needs no order: every worker computes alike, bit for bit."""

    name = "ray"

    def __init__(self, ledger: Ledger, device: torch.device, workers: int, spare: Sequence[Any] = ()) -> None:
        super().__init__(ledger, device)
        self.concurrency = workers  # clients on different actors train at once
        self._lock = threading.Lock()  # the ledger's counts, when clients run concurrently
        self.hosts: list[Any] = []  # the actors, stopped by close(): the client workers, then the server's
        self.spare = list(spare)  # the previous attempt's live actors, rebuilt before new ones start
        self.started = 0  # new actors this attempt started (the rest: spare ones rebuilt)
        self.clients: dict[int, RemoteRole] = {}  # every client, on the worker that holds it now
        self.remote_bytes = 0  # request and reply bytes between the driver and the actors, since the last row
        self.startup_seconds: float | None = None  # building the roles on the actors, waiting for CPUs included
        self._free = set(range(workers))  # the client workers no client trains on now
        self._freed = threading.Condition()
        self.busy_seconds = [0.0] * workers  # by client worker, since the start: what `lease` balances
        self._load = [0.0] * workers  # by client worker, since the last row
        self.moves = 0  # clients moved to another worker, since the last row

    def install_noise_secret(self, blueprint: Any, secret: bytes) -> None:
        super().install_noise_secret(blueprint, secret)
        ray = cluster.connect("auto")
        ray.get([host.set_noise_secret.remote(secret) for host in self.hosts])

    @contextlib.contextmanager
    def lease(self, client_id: int) -> Iterator[None]:
        """Client `client_id` trains on a free client worker: the one holding it if free, else the free
        one busy least so far (the client's state moves there); its time there is the worker's load."""
        client = self.clients[client_id]
        with self._freed:
            while (picked := self._pick(client)) is None:
                self._freed.wait()
            worker = picked
            self._free.remove(worker)
        started = time.perf_counter()
        try:
            if worker != client.worker:
                self._move(client, worker)
            yield
        finally:
            with self._freed:
                seconds = time.perf_counter() - started
                self.busy_seconds[worker] += seconds
                self._load[worker] += seconds
                self._free.add(worker)
                self._freed.notify_all()

    def _pick(self, client: RemoteRole) -> int | None:
        """The free client worker `client` trains on: its own, else the one busy least so far (None:
        none is free)."""
        if client.worker in self._free:
            return client.worker
        return min(self._free, key=lambda worker: (self.busy_seconds[worker], worker), default=None)

    def _move(self, client: RemoteRole, worker: int) -> None:
        """`client`'s state from the actor holding it to client worker `worker`, actor to actor."""
        moving = client.host.give_up.remote(client.key)
        wait_for(self.hosts[worker].adopt.remote(client.key, moving), f"moving client {client.key}")
        client.host, client.worker = self.hosts[worker], worker
        with self._lock:
            self.moves += 1

    def close(self) -> None:
        """Stop the actors now (not when Ray notices the run let go of them): their CPUs are free for the next run."""
        ray = cluster.ray_module()
        for host in [*self.hosts, *self.spare]:
            ray.kill(host)
        self.hosts, self.spare = [], []

    def hand_over(self) -> list[Any]:
        """After an actor was lost: the actors that still answer (within HAND_OVER_SECONDS), taken
        out of this transport for the run's next attempt to rebuild; close() stops the others."""
        ray = cluster.ray_module()
        probes = [host.ready.remote() for host in self.hosts]
        answered, _ = ray.wait(probes, num_returns=len(probes), timeout=HAND_OVER_SECONDS)

        def answers(probe: Any) -> bool:
            try:
                return probe in answered and ray.get(probe) is None
            except ray.exceptions.RayError:
                return False

        hosts, self.hosts = self.hosts, []
        alive: list[Any] = []
        for host, probe in zip(hosts, probes):
            (alive if answers(probe) else self.hosts).append(host)
        return alive

    def pop_seconds(self) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for phases in wait_for([host.pop_seconds.remote() for host in self.hosts], "the round's timings"):
            for phase, value in phases.items():
                seconds[phase] = seconds.get(phase, 0.0) + value
        return seconds

    def pop_telemetry(self) -> dict[str, Any]:
        figures: dict[str, Any] = {
            "driver_actor_bytes": self.remote_bytes,
            "ray_worker_seconds": [round(seconds, 4) for seconds in self._load],
            "ray_client_moves": self.moves,
        }
        if self.startup_seconds is not None:  # in the attempt's first row only
            figures["ray_startup_seconds"], self.startup_seconds = self.startup_seconds, None
            figures["ray_actors_started"] = self.started
        self.remote_bytes, self.moves, self._load = 0, 0, [0.0] * len(self._load)
        return figures

    def personal_metrics(self, algorithm: Any, client_ids: list[int]) -> list[dict[str, float]]:
        """Every client's personal-model test metrics, computed on the actors holding the clients:
        the server part goes once to each worker, and metrics come back (no client model travels)."""
        client_slot, server_slot = algorithm.personal_slots
        request = codec.encode({"slot": client_slot, "server": algorithm.server.snapshot(server_slot)})
        workers = self.hosts[:-1]
        replies = wait_for([host.personal_metrics.remote(request) for host in workers], "evaluation")
        with self._lock:
            self.remote_bytes += len(request) * len(workers) + sum(len(reply) for reply in replies)
        answers = [json.loads(reply) for reply in replies]
        by_id = {int(k): metrics for answer in answers for k, metrics in answer["trained"].items()}
        untrained: dict[str, float] = next(
            (answer["untrained"] for answer in answers if answer["untrained"] is not None), {}
        )
        return [by_id.get(k, untrained) for k in client_ids]

    def personal_logits(self, algorithm: Any, client_ids: list[int]) -> list[torch.Tensor]:
        """test_split=client: every client's personal-model logits on the samples it holds out,
        computed on the workers holding the clients (the server part goes once to each worker that
        holds one; no client model travels), in the order of `client_ids`."""
        client_slot, server_slot = algorithm.personal_slots
        server = algorithm.server.snapshot(server_slot)
        by_worker: dict[int, list[int]] = {}
        for k in client_ids:
            by_worker.setdefault(self.clients[k].worker, []).append(k)
        requests = {
            w: codec.encode({"slot": client_slot, "server": server, "clients": ks}) for w, ks in by_worker.items()
        }
        pending = [self.hosts[w].personal_logits.remote(request) for w, request in requests.items()]
        replies = wait_for(pending, "evaluation")
        with self._lock:
            self.remote_bytes += sum(map(len, requests.values())) + sum(map(len, replies))
        logits = {int(k): t for reply in replies for k, t in codec.decode(reply, self.device).items()}
        return [logits[k] for k in client_ids]

    def connect(self, role: object, counted: bool) -> Proxy:
        if isinstance(role, RemoteRole):
            return Proxy(self, role, counted, role.role_class)
        return Proxy(self, role, counted)

    def call(self, method: Callable[..., Any], spec: VerbSpec, counted: bool, *args: Any, **kwargs: Any) -> Any:
        if isinstance(method, RemoteVerb):
            request = codec.encode({"args": list(args), "kwargs": kwargs})
            reply = method(request)
            result = codec.decode(reply, self.device)
            with self._lock:
                self.ledger.envelope_bytes += len(request) + len(reply)
                self.remote_bytes += len(request) + len(reply)
                if counted:
                    self._count(spec.down, args, (args, kwargs), int(method.key))
                    self._count(spec.up, args, result, int(method.key))
            return result
        with self._lock:
            return super().call(method, spec, counted, *args, **kwargs)


def start_roles(plan: Plan, transport: RayTransport) -> tuple[dict[int, RemoteRole], RemoteRole]:
    """Start `workers` client actors (node k on worker k mod `workers`) and the training server's
    actor (local Ray, or the cluster RAY_ADDRESS names); each gets through Ray's object store what
    the plan says its roles hold (`Plan.actor_loads`: the dataset, put once, for clients holding
    samples; a vertical party's columns of its rows, not the dataset). Return the remote nodes by
    id, and the remote server."""
    run = plan.config.run
    ray = _connected(run)
    placed = [list(range(w, plan.node_count, run.workers)) for w in range(run.workers)]
    refs: dict[int, Any] = {}  # one object put once, where every worker gets the same
    loads = [refs.setdefault(id(load), ray.put(load)) for load in plan.actor_loads(placed)]
    server_load = plan.server_load()
    hosts, server_host = _start_actors(
        plan.config,
        list(zip(loads, placed)),
        None if server_load is None else ray.put(server_load),
        plan.blueprint,
        transport,
    )
    transport.clients = {
        k: RemoteRole(plan.node_class(k), hosts[k % run.workers], k, k % run.workers) for k in range(plan.node_count)
    }
    return dict(transport.clients), RemoteRole(plan.server_class, server_host, SERVER)


def _connected(run: Any) -> Any:
    """Ray, connected, with room for the run's `workers + 1` actors (else one line: Ray would wait for ever)."""
    ray = cluster.connect("auto")
    actors = run.workers + 1  # the client workers and the training server
    total = ray.cluster_resources()
    for unit, each, key in (
        ("CPU", run.cpus_per_client, "cpus_per_client"),
        ("GPU", run.gpus_per_client, "gpus_per_client"),
    ):
        needed, available = actors * each, total.get(unit, 0)
        if available < needed:  # the actors would wait for them for ever
            raise UserError(
                f"backend=ray workers={run.workers} {key}={each:g} needs {needed:g} {unit}s in the Ray cluster "
                f"(the client workers and the training server), which has {available:g}; lower workers or "
                f"{key}, or add nodes"
            )
    return ray


def _start_actors(
    config: ResolvedConfig,
    loads: list[tuple[Any, list[int]]],
    server_load: Any,
    blueprint: Blueprint,
    transport: RayTransport,
) -> tuple[list[Any], Any]:
    """The client workers (worker w: `loads[w]`, what it gets and the roles it holds) and the
    training server's actor (`server_load`; None: the data's shape alone), built, in
    `transport.hosts`: the spare actors of the run's previous attempt first (every actor of a run
    asks for the same resources), then new ones; a failure to build, one line per node, after the
    actors are stopped."""
    ray = cluster.ray_module()
    run = config.run
    Host = ray.remote(num_cpus=run.cpus_per_client, num_gpus=run.gpus_per_client, **ray_options(run.plugins))(RoleHost)
    config_json, data_shape = json.dumps(config.as_dict()), data_shape_of(blueprint)

    def built(load: Any, placed: list[int] | None) -> tuple[Any, Any]:
        """An actor holding these roles, and the call that answers once they are built (None, or why not)."""
        if transport.spare:
            actor = transport.spare.pop()
            return actor, actor.rebuild.remote(config_json, load, placed, data_shape)
        transport.started += 1
        actor = Host.remote(config_json, load, placed, data_shape)
        return actor, actor.ready.remote()

    placed = [built(load, roles) for load, roles in [*loads, (server_load, None)]]
    transport.hosts = [actor for actor, _ in placed]
    started = time.perf_counter()
    failures = sorted({failure for failure in wait_for([ready for _, ready in placed], "start") if failure})
    if failures:  # one line per node, the first failure of each
        transport.close()
        raise UserError("; ".join(failures))
    transport.startup_seconds = time.perf_counter() - started
    return transport.hosts[:-1], transport.hosts[-1]
