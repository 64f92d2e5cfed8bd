"""A finished run rebuilt in this process with its final weights back in its roles, for what reads
a run after it ends (`splitlab evaluate`, `splitlab attack`): the model a client would deploy,
the global model, each personal part where it belongs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from splitlab import rundir
from splitlab.algorithms.splitgp import SplitGP
from splitlab.assembly import Experiment
from splitlab.build import build
from splitlab.codec import read_tensors
from splitlab.errors import UserError
from splitlab.roles import State
from splitlab.settings import stored_setting


def _named_like(template: State, tensors: dict[str, torch.Tensor], prefix: str, path: Path) -> State:
    """`template`'s keys, valued from `tensors` under `prefix` (shapes are checked when loaded)."""
    try:
        return {key: tensors[prefix + key] for key in template}
    except KeyError as error:
        raise UserError(f"{str(path)!r} lacks the tensor {error.args[0]!r}; it is not this run's") from None


def global_states(experiment: Experiment) -> list[State]:
    """The final global model of a finished run (`weights.safetensors`), as the parts of its
    `global_model()`, client side first."""
    template = experiment.algorithm.global_model()
    if template is None:
        raise UserError(
            f"{experiment.config.run.algorithm!r} runs keep no global model; their clients' models are "
            f"in clients.safetensors"
        )
    return _read_parts(experiment, template)


def _read_parts(experiment: Experiment, template: list[State]) -> list[State]:
    path = experiment.out / "weights.safetensors"
    weights = read_tensors(path, experiment.blueprint.device)
    return [_named_like(part, weights, "", path) for part in template]


def final_states(experiment: Experiment, client_id: int = 0) -> list[State]:
    """The model client `client_id` of a run `load_run` rebuilt would deploy, client side first:
    the global model, or with personal client parts its own part and the shared server part."""
    if experiment.algorithm.personal_models:
        return experiment.algorithm.personal_model(client_id)
    return global_states(experiment)


def _restore(proxy: Any, models: dict[str, State], path: Path) -> None:
    """Weights into a role's slots, through its `load_state_dict` verb (telemetry, never counted)."""
    try:
        proxy.load_state_dict({"models": models, "optimizers": {}})
    except RuntimeError as error:
        reason = " ".join(str(error).split())[:200]  # torch's message spans lines
        raise UserError(f"{str(path)!r} does not fit this run's models: {reason}") from None


def load_run(run_dir: str | Path, device: str = "cpu") -> Experiment:
    """Rebuild a finished run (data, roles) and load its final weights; those of a run with personal
    client parts go back into its roles: the server part to the server, client k's own part (SplitGP:
    phi_k and h_k) to client k, and SplitGP's averaged phi to the sync server."""
    path = Path(run_dir)
    if not (path / "summary.json").is_file():
        raise UserError(f"{str(path)!r} holds no finished run (no summary.json); finish it with resume=true")
    stored = rundir.stored_config(path, "evaluate", "point evaluate at the directory of a finished run")
    assert stored_setting(stored).whole_samples, "a vertical run is read by splitlab.settings.vertical.load_final"
    experiment = build({**stored, "device": device, "out": str(path), "backend": "local"})  # in this process
    algorithm = experiment.algorithm
    weights = path / "weights.safetensors"
    shared = algorithm.shared_model()
    if shared is None:
        raise UserError(f"{experiment.config.run.algorithm!r} runs keep no model that evaluate can read")
    parts = _read_parts(experiment, shared)  # fails on a run that did not write its model
    if isinstance(algorithm, SplitGP):
        _restore(algorithm.sync, {"client_model": parts[0]}, weights)
    if isinstance(algorithm, SplitGP) or algorithm.personal_models:
        _restore(algorithm.server, {"server_model": parts[-1]}, weights)
        clients_path = path / "clients.safetensors"
        tensors = read_tensors(clients_path, experiment.blueprint.device)
        own = (
            (("client", "client_model"), ("exit", "aux_model"))
            if isinstance(algorithm, SplitGP)
            else (("client", "client_model"),)
        )
        for client in experiment.clients:
            proxy = algorithm.client(client.id)
            models = {
                slot: _named_like(proxy.snapshot(slot), tensors, f"{name}.{client.id}.", clients_path)
                for name, slot in own
            }
            _restore(proxy, models, clients_path)
    return experiment


def check_columns_in_one_process(stored: dict[str, Any], path: Path, command: str, beside: str, so: str) -> None:
    """Refuse `command` on a vertical data=own run: it needs every party's columns of the test
    samples in one process (`beside` what else), and each party's stayed in its own files (`so`:
    what follows from that)."""
    if stored.get("data") == "own":
        raise UserError(
            f"{command} on a vertical run needs every party's columns of the test samples in one process{beside}; "
            f"{str(path)!r} is a data=own run: each party's columns stayed in its own files{so}"
        )
