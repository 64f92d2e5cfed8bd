"""backend=ray: client nodes on a fixed pool of long-lived Ray actors, the training server on its own.

Each of the `workers` actors holds many virtual clients (client k on actor k mod workers), built
in the actor from the run's configuration and the indices of its clients' samples: the samples
never leave the machine that loads them. The training server is one more actor; the sync server
and the algorithm stay in the driver, with the engine. Every verb call and its result travel as
`splitlab.codec` bytes (safetensors + JSON), as through the serialized transport, so results are
bit for bit those of an in-process run. Ray itself pickles what it carries (here: those bytes,
client ids and verb names), between processes of a cluster the user started and trusts.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from splitlab import cluster, codec
from splitlab.channel import Ledger
from splitlab.config import ResolvedConfig, resolve_config
from splitlab.errors import UserError
from splitlab.plugins import ray_options
from splitlab.process import peak_memory_mib, set_worker_threads
from splitlab.roles import Role
from splitlab.transport import Proxy, SerializedTransport, VerbSpec

SERVER = "server"  # the training server's key in its actor


class RoleHost:
    """A Ray actor's roles: the client nodes of `owners` (client id -> sample indices), or, without
    owners, the training server; built from the configuration alone, as in the driver."""

    def __init__(self, config_json: str, owners: bytes | None) -> None:
        from splitlab import engine
        from splitlab.algorithms import get_algorithm
        from splitlab.data import load_dataset

        set_worker_threads(1)
        config = resolve_config(json.loads(config_json))
        run = config.run
        self.device = engine.resolve_device(run.device)
        data = load_dataset(run.dataset, run.data_dir, seed=run.seed)
        blueprint = engine.make_blueprint(config, data, self.device)
        self.roles: dict[int | str, Role]
        if owners is None:
            self.roles = {SERVER: get_algorithm(run.algorithm).Server(blueprint)}
        else:
            indices = {int(k): idx.numpy() for k, idx in codec.decode(owners).items()}
            self.roles = {node.id: node for node in engine.client_nodes(blueprint, data, indices)}

    def peak_memory_mib(self) -> float:
        """This actor's peak resident set size (benchmarks/ray_clients.py)."""
        return peak_memory_mib()

    def call(self, key: int | str, name: str, request: bytes) -> bytes:
        """Role `key`'s verb `name` on the decoded request; the result encoded. Only verbs are called."""
        role = self.roles[key]
        if getattr(getattr(type(role), name, None), "__verb__", None) is None:
            raise AttributeError(f"{type(role).__name__}.{name} is not a verb")
        message = codec.decode(request, self.device)
        return codec.encode(getattr(role, name)(*message["args"], **message["kwargs"]))


class RemoteVerb:
    """One verb of a role in a Ray actor: request bytes in, result bytes out (waits for the result)."""

    def __init__(self, host: Any, key: int | str, name: str) -> None:
        self.host, self.key, self.name = host, key, name

    def __call__(self, request: bytes) -> bytes:
        return cluster.ray_module().get(self.host.call.remote(self.key, self.name, request))


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
        self.hosts: list[Any] = []  # the actors, stopped by close()

    def close(self) -> None:
        """Stop the actors now (not when Ray notices the run let go of them): their CPUs are free for the next run."""
        ray = cluster.ray_module()
        for host in self.hosts:
            ray.kill(host)
        self.hosts = []

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
                if counted:
                    self._count(spec.down, args, (args, kwargs))
                    self._count(spec.up, args, result)
            return result
        with self._lock:
            return super().call(method, spec, counted, *args, **kwargs)


def start_roles(
    config: ResolvedConfig, owners: Mapping[int, np.ndarray], transport: RayTransport
) -> tuple[dict[int, RemoteRole], RemoteRole]:
    """Start `workers` client actors and the training server's actor (local Ray, or the cluster
    RAY_ADDRESS names); return the remote client roles by id, and the remote server."""
    from splitlab.algorithms import get_algorithm

    ray = cluster.connect("auto")
    run = config.run
    needed = run.workers + 1
    available = ray.cluster_resources().get("CPU", 0)
    if available < needed:  # the actors would wait for CPUs for ever
        raise UserError(
            f"backend=ray workers={run.workers} needs {needed} CPUs in the Ray cluster (the client "
            f"workers and the training server), which has {available:g}; lower workers or add nodes"
        )
    algorithm_class = get_algorithm(run.algorithm)
    Host = ray.remote(num_cpus=1, **ray_options(run.plugins))(RoleHost)
    config_json = json.dumps(config.as_dict())
    shares = [{k: idx for k, idx in owners.items() if k % run.workers == w} for w in range(run.workers)]
    hosts = [
        Host.remote(config_json, codec.encode({str(k): torch.as_tensor(idx) for k, idx in share.items()}))
        for share in shares
    ]
    server_host = Host.remote(config_json, None)
    transport.hosts = [*hosts, server_host]
    clients = {k: RemoteRole(algorithm_class.Client, hosts[k % run.workers], k) for k in owners}
    return clients, RemoteRole(algorithm_class.Server, server_host, SERVER)
