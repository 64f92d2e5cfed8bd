"""backend=ray: client nodes on a fixed pool of long-lived Ray actors, the training server on its own.

Each of the `workers` actors holds many virtual clients (client k on actor k mod workers), built
in the actor from the run's configuration and the indices of its clients' samples: the samples
never leave the machine that loads them. The training server is one more actor, built from the
data's shape alone (it holds no samples); the sync server and the algorithm stay in the driver,
with the engine. Personal models are evaluated on the actors that hold them (only metrics come
back), and a lost actor raises `RoleLost`, on which the engine builds the actors again and
replays from the last checkpoint. Every verb call and its result travel as
`splitlab.codec` bytes (safetensors + JSON), as through the serialized transport, so results are
bit for bit those of an in-process run. Ray itself pickles what it carries (here: those bytes,
client ids and verb names), between processes of a cluster the user started and trusts.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from splitlab import cluster, codec
from splitlab.config import ResolvedConfig, resolve_config
from splitlab.errors import NonFiniteStep, RoleLost, UserError
from splitlab.ledger import Ledger
from splitlab.metrics import TASK_METRICS
from splitlab.plugins import ray_options
from splitlab.process import peak_memory_mib, set_worker_threads
from splitlab.roles import Blueprint, Role, State
from splitlab.transport import Proxy, SerializedTransport, VerbSpec

SERVER = "server"  # the training server's key in its actor


class RoleHost:
    """A Ray actor's roles: the client nodes of `owners` (client id -> sample indices), or, without
    owners, the training server, from the data's shape alone (`data_shape`, JSON); built from the
    configuration, as in the driver. A bad setting found while building (a node without the
    dataset) is kept, not raised, for `ready` to report with the node's id and hostname."""

    def __init__(self, config_json: str, owners: bytes | None, data_shape: str) -> None:
        from splitlab import engine

        config = resolve_config(json.loads(config_json))
        set_worker_threads(config.run.cpus_per_client)
        # torch's first optimizer step imports torch._dynamo (1.5 s): here, while the actors start, not
        # as a stall in the first round of every actor
        importlib.import_module("torch._dynamo")
        self.failure: str | None = None
        try:
            self._build(config, owners, data_shape, engine)
        except UserError as error:
            self.failure = f"{cluster.this_node()}: {error}"

    def _build(self, config: ResolvedConfig, owners: bytes | None, data_shape: str, engine: Any) -> None:
        from splitlab.algorithms import get_algorithm

        run = config.run
        algorithm = get_algorithm(run.algorithm)
        self.device = assigned_device() if run.device == "auto" else engine.resolve_device(run.device)
        self.roles: dict[int | str, Role]
        if owners is None:  # the training server holds no samples: it never loads them
            shape = json.loads(data_shape)
            dtype = getattr(torch, shape["input_dtype"].removeprefix("torch."))
            self.blueprint = engine.blueprint_of(
                config, self.device, tuple(shape["input_shape"]), shape["num_classes"], dtype, shape["task"]
            )
            self.roles = {SERVER: algorithm.Server(self.blueprint)}
        else:
            data = engine.load_data(run)
            self.metrics = TASK_METRICS[data.task]
            self.blueprint = engine.make_blueprint(config, data, self.device)
            indices = {int(k): idx.numpy() for k, idx in codec.decode(owners).items()}
            self.roles = {node.id: node for node in engine.client_nodes(self.blueprint, data, indices)}
            if algorithm.personal_models:  # evaluated here, where the personal models are
                self.test = engine.test_set(config, data, self.device)
                self.assemble = engine.Assembler(self.blueprint)

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

    def personal_metrics(self, request: bytes) -> str:
        """The test metrics of the personal models here (each client's `slot`, then the server part
        the request holds), as JSON: {"trained": {client id: metrics}, "untrained": metrics}. The
        clients that never trained the slot all hold its initial weights: evaluated once, for all of
        them, so the work and the reply follow the clients that trained, not K."""
        from splitlab import engine

        message = codec.decode(request, self.device)
        slot, server = message["slot"], message["server"]
        x, y = self.test

        def metrics(client_state: State) -> dict[str, float]:
            return engine.personal_metrics(
                self.assemble, [client_state, server], x, y, self.blueprint.inference_batch, self.metrics
            )

        trained = {str(k): metrics(role.snapshot(slot)) for k, role in self.roles.items() if slot in role.models}
        untrained = metrics(self.blueprint.initial_state(slot)) if len(trained) < len(self.roles) else None
        return json.dumps({"trained": trained, "untrained": untrained})


def assigned_device() -> torch.device:
    """device=auto in an actor: the GPU Ray gave it (gpus_per_client > 0), else the CPU, even on a node
    with GPUs (Ray no longer hides them from actors that asked for none)."""
    return torch.device("cuda" if cluster.ray_module().get_gpu_ids() else "cpu")


class RemoteVerb:
    """One verb of a role in a Ray actor: request bytes in, result bytes out (waits for the result)."""

    def __init__(self, host: Any, key: int | str, name: str) -> None:
        self.host, self.key, self.name = host, key, name

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
    """A role in a Ray actor, as the driver's proxies reach it: its verbs are `RemoteVerb`s."""

    def __init__(self, role_class: type, host: Any, key: int | str) -> None:
        self.role_class, self.host, self.key = role_class, host, key

    def __getattr__(self, name: str) -> RemoteVerb:
        if name.startswith("__"):
            raise AttributeError(name)
        return RemoteVerb(self.host, self.key, name)


class RayTransport(SerializedTransport):
    """Verb calls to roles in Ray actors as codec bytes; to roles in this process (the sync server)
    encoded and decoded here, as by the serialized transport. Safe to call from several threads."""

    name = "ray"

    def __init__(self, ledger: Ledger, device: torch.device, workers: int) -> None:
        super().__init__(ledger, device)
        self.concurrency = workers  # clients on different actors train at once
        self._lock = threading.Lock()  # the ledger's counts, when clients run concurrently
        self.hosts: list[Any] = []  # the actors, stopped by close(): the client workers, then the server's
        self.remote_bytes = 0  # request and reply bytes between the driver and the actors, since the last row
        self.startup_seconds: float | None = None  # building the roles on the actors, waiting for CPUs included

    def close(self) -> None:
        """Stop the actors now (not when Ray notices the run let go of them): their CPUs are free for the next run."""
        ray = cluster.ray_module()
        for host in self.hosts:
            ray.kill(host)
        self.hosts = []

    def pop_seconds(self) -> dict[str, float]:
        seconds: dict[str, float] = {}
        for phases in wait_for([host.pop_seconds.remote() for host in self.hosts], "the round's timings"):
            for phase, value in phases.items():
                seconds[phase] = seconds.get(phase, 0.0) + value
        return seconds

    def pop_telemetry(self) -> dict[str, Any]:
        figures: dict[str, Any] = {"driver_actor_bytes": self.remote_bytes}
        if self.startup_seconds is not None:  # in the first row only
            figures["ray_startup_seconds"], self.startup_seconds = self.startup_seconds, None
        self.remote_bytes = 0
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


def install_noise_secret(transport: RayTransport, secret: bytes) -> None:
    """Every actor's roles get the run's noise secret."""
    ray = cluster.connect("auto")
    ray.get([host.set_noise_secret.remote(secret) for host in transport.hosts])


def start_roles(
    config: ResolvedConfig, owners: Mapping[int, np.ndarray], blueprint: Blueprint, transport: RayTransport
) -> tuple[dict[int, RemoteRole], RemoteRole]:
    """Start `workers` client actors and the training server's actor (local Ray, or the cluster
    RAY_ADDRESS names); return the remote client roles by id, and the remote server."""
    from splitlab.algorithms import get_algorithm

    ray = cluster.connect("auto")
    run = config.run
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
    algorithm_class = get_algorithm(run.algorithm)
    Host = ray.remote(num_cpus=run.cpus_per_client, num_gpus=run.gpus_per_client, **ray_options(run.plugins))(RoleHost)
    config_json = json.dumps(config.as_dict())
    shares = [{k: idx for k, idx in owners.items() if k % run.workers == w} for w in range(run.workers)]
    hosts = [
        Host.remote(config_json, codec.encode({str(k): torch.as_tensor(idx) for k, idx in share.items()}), "")
        for share in shares
    ]
    data_shape = {
        "input_shape": list(blueprint.input_shape),
        "num_classes": blueprint.num_classes,
        "input_dtype": str(blueprint.input_dtype),
        "task": blueprint.task,
    }
    server_host = Host.remote(config_json, None, json.dumps(data_shape))
    transport.hosts = [*hosts, server_host]
    started = time.perf_counter()
    failures = sorted(
        {failure for failure in wait_for([h.ready.remote() for h in transport.hosts], "start") if failure}
    )
    if failures:  # one line per node, the first failure of each
        transport.close()
        raise UserError("; ".join(failures))
    transport.startup_seconds = time.perf_counter() - started
    clients = {k: RemoteRole(algorithm_class.Client, hosts[k % run.workers], k) for k in owners}
    return clients, RemoteRole(algorithm_class.Server, server_host, SERVER)
