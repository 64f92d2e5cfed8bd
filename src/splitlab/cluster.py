"""Ray, for sweeps over a cluster and `backend=ray` runs: connecting, and shared storage.

Ray is an optional extra (`pip install 'splitlab[ray]'`), imported only here and by the code
that runs on it. Every node writes run directories and checkpoints itself, so the sweep or run
directory must be on storage every node sees at the same path (NFS, a shared disk, or one
machine). `check_shared_storage` proves it before anything runs: the driver writes a random
token into the directory and a task pinned to every node reads it back.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from splitlab.errors import UserError

PROBE = ".splitlab-storage-probe"  # written and removed by check_shared_storage


def ray_module() -> ModuleType:
    try:
        import ray
    except ImportError:
        raise UserError("Ray is not installed; install it with: pip install 'splitlab[ray]'") from None
    return ray


CONNECT_TIMEOUT = (
    10.0  # seconds to wait for the cluster's address to answer, before ray.init (which retries for minutes)
)


def connect(address: str) -> ModuleType:
    """Ray, connected to `address` unless this process already is: "auto" is the cluster RAY_ADDRESS
    names, else the one `ray start` started on this machine, else a new local Ray;
    "ray://host:port" or "host:port" is that cluster. A named address must answer within
    CONNECT_TIMEOUT (ray.init alone retries for minutes); a failure is one line naming the cause."""
    ray = ray_module()
    if not ray.is_initialized():
        named = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
        if named and named not in ("auto", "local"):
            check_answers(named)
            if not named.startswith("ray://"):  # a cluster's own address: its GCS, which can say at once
                check_authentication(named)
        try:
            ray.init(address=None if address == "auto" else address, include_dashboard=False, log_to_driver=False)
        except ray.exceptions.AuthenticationError as error:
            raise UserError(
                f"Ray at {named or address!r} refused this process's authentication ({error.message}): the "
                f"cluster uses token authentication; set RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN "
                f"(or RAY_AUTH_TOKEN_PATH), as on its nodes"
            ) from None
        except (ConnectionError, RuntimeError, ValueError) as error:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            hint = (
                "; something answers there, so the likely cause is authentication: current Ray clusters use "
                "tokens, set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN, as on its nodes "
                "(else: the same Ray version as the cluster's?)"
                if named
                else ""
            )
            raise UserError(f"cannot connect to Ray at {named or address!r}: {first}{hint}") from None
    return ray


def check_answers(address: str) -> None:
    """UserError unless something accepts a TCP connection at `address` ([ray://]host:port) within
    CONNECT_TIMEOUT seconds: a wrong address fails at once, not after ray.init's minutes of retries."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"Ray address {address!r} is not host:port or ray://host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT).close()
    except OSError as error:
        raise UserError(
            f"nothing answers at Ray address {address!r} ({error.strerror or error}); start the cluster "
            f"(`ray start --head`) or correct the address"
        ) from None


def check_authentication(address: str) -> None:
    """UserError if the Ray cluster at `address` (its GCS, host:port) refuses this process's
    authentication: one request, answered at once, where ray.init would retry for 30 s and print
    a warning a second. Anything else is left to ray.init to report."""
    ray = ray_module()
    gcs_client = getattr(importlib.import_module("ray._raylet"), "GcsClient", None)  # Ray's own; not public
    if gcs_client is None:
        return
    try:
        with _quiet_stderr():  # Ray's C++ client prints the refusal too, as a warning
            gcs_client(address=address)
    except ray.exceptions.AuthenticationError as error:
        cause = str(error).removeprefix("RPC error: ").split(". ")[0]
        raise UserError(
            f"Ray at {address!r} uses token authentication and refused this process ({cause}): set "
            f"RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN (or a file named by "
            f"RAY_AUTH_TOKEN_PATH), as on its nodes"
        ) from None
    except Exception:  # noqa: BLE001 - not an authentication failure: ray.init says what it is
        return


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null (what C++ libraries write there too), then back."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def this_node() -> str:
    """The Ray node this process runs on, as failures name it: its id and its hostname."""
    return f"Ray node {ray_module().get_runtime_context().get_node_id()} ({socket.gethostname()})"


def _reads_token(path: str, token: str) -> bool:
    try:
        return Path(path).read_text() == token
    except OSError:
        return False


def nodes_not_seeing(path: Path, token: str) -> list[str]:
    """The addresses of the alive Ray nodes on which `path` does not hold `token`."""
    ray = ray_module()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0)(_reads_token)
    nodes = [node for node in ray.nodes() if node["Alive"]]
    seen = ray.get(
        [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
                str(path), token
            )
            for node in nodes
        ]
    )
    return [node["NodeManagerAddress"] for node, ok in zip(nodes, seen) if not ok]


def check_shared_storage(directory: Path) -> None:
    """UserError unless every Ray node sees `directory` (an absolute path) as this process does."""
    directory.mkdir(parents=True, exist_ok=True)
    probe, token = directory / PROBE, secrets.token_hex(16)
    probe.write_text(token)
    try:
        blind = nodes_not_seeing(probe, token)
    finally:
        probe.unlink(missing_ok=True)
    if blind:
        raise UserError(
            f"{str(directory)!r} is not on storage every Ray node shares (Ray node(s) {', '.join(blind)} "
            f"do not see it): put the run or sweep directory on a shared file system mounted at the same path"
        )


def resources(cpus: Any, gpus: Any) -> dict[str, float]:
    """Ray resources of one run, checked: whole CPUs >= 1, GPUs >= 0 (fractions share a GPU)."""
    if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
        raise UserError(f"--cpus-per-run must be an integer >= 1, got {cpus!r}")
    if isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or gpus < 0:
        raise UserError(f"--gpus-per-run must be a number >= 0, got {gpus!r}")
    return {"num_cpus": cpus, "num_gpus": float(gpus)}


def check_fits(resources: dict[str, float]) -> None:
    """UserError unless some alive Ray node has the CPUs and GPUs of one run (else Ray waits for ever)."""
    cpus, gpus = resources["num_cpus"], resources["num_gpus"]
    nodes = [node["Resources"] for node in ray_module().nodes() if node["Alive"]]
    if not any(node.get("CPU", 0) >= cpus and node.get("GPU", 0) >= gpus for node in nodes):
        raise UserError(
            f"--cpus-per-run {cpus:g} --gpus-per-run {gpus:g} fits no Ray node (the largest has "
            f"{max((n.get('CPU', 0) for n in nodes), default=0):g} CPUs and "
            f"{max((n.get('GPU', 0) for n in nodes), default=0):g} GPUs)"
        )
