"""The paper's evaluation (Section VI): per-client test sets with a fraction rho of
out-of-distribution samples, SplitGP's entropy gate, and the baselines in the same view.

Client k's test set = every test sample of its main classes (the classes present in D_k) plus
round(rho * that many) samples drawn from the other classes; the overall accuracy is the mean of
the clients' accuracies. The out-of-distribution draws are nested (rho = 0.4 extends rho = 0.2).

`entropy_threshold=auto` picks E_th per rho from the paper's grid on a validation view built the
same way from *training* samples client k never trained on (the training set minus D_k, at most
`validation_size` main-class samples): phi_k and h_k have not seen them, theta has seen those
other clients hold, which makes the server look somewhat better there than on test data.

Rows for a SplitGP run: `splitgp` (gated), `client model` (h_k always), `full model` (theta
always) and `splitgp (E_th chosen on test)`, an optimistic reference that is not a result.
Rows for a run with one global model (e.g. fedavg): `generalized` (that model) and
`personalized` (it, after `finetune_rounds` more local updates per client that are never
averaged: FedAvg + local fine-tuning, the simplest personalization that needs no training
algorithm of its own). A SplitGP run with personalization=0 is the multi-exit FedAvg baseline.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator
from safetensors.torch import load_file
from torch import nn

from splitlab.algorithms.splitgp import SplitGP
from splitlab.channel import Channel
from splitlab.engine import Experiment, build
from splitlab.errors import UserError
from splitlab.splitgp import parse_settings
from splitlab.io import write_json
from splitlab.metrics import logits_in_batches

#: The paper's candidate entropy thresholds (Section VI).
ENTROPY_GRID = (0.05, 0.1, 0.2, 0.4, 0.8, 1.2, 1.6, 2.3)
_STREAM_VIEW, _STREAM_VALIDATION = 10, 11


class EvaluationSettings(BaseModel):
    """The `splitlab evaluate` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rho: list[float] = Field([0, 0.2, 0.4, 0.6, 0.8], description="out-of-distribution fractions")
    entropy_threshold: float | str = Field("auto", description="E_th, or auto (chosen per rho on held-out data)")
    validation_size: int = Field(200, ge=1, description="main-class held-out samples per client for auto")
    finetune_rounds: int = Field(1, ge=0, description="local updates for the personalized baseline")
    device: str = "cpu"

    @field_validator("rho", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, (int, float)):
            return [value]
        if isinstance(value, str):
            try:
                return [float(v) for v in value.split(",")]
            except ValueError:
                raise ValueError("rho must be a comma-separated list of numbers >= 0") from None
        return value

    @field_validator("rho")
    @classmethod
    def _non_negative(cls, value: list[float]) -> list[float]:
        if not value or min(value) < 0:
            raise ValueError("rho must be a comma-separated list of numbers >= 0")
        return value

    @field_validator("entropy_threshold", mode="before")
    @classmethod
    def _threshold(cls, value: Any) -> float | str:
        if value == "auto":
            return value
        try:
            number = float(value)  # YAML reads 1e9 as a string
        except (TypeError, ValueError):
            number = -1.0
        if not number >= 0:
            raise ValueError("entropy_threshold must be auto or a number >= 0")
        return number


# --- the entropy gate (Algorithm 1, inference phase) ----------------------------------------------
def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row's softmax."""
    return -(F.softmax(logits, dim=1) * F.log_softmax(logits, dim=1)).sum(dim=1)


def to_server(client_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """Eq. (11): a sample leaves the client exactly when its client entropy exceeds E_th."""
    return entropy(client_logits) > threshold


@torch.no_grad()
def gated_predict(phi: nn.Module, head: nn.Module, theta: nn.Module, x: torch.Tensor, threshold: float,
                  channel: Channel) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions of one client's deployed SplitGP, and which samples the server decided."""
    features = phi(x)
    client_logits = head(features)
    routed = to_server(client_logits, threshold)
    predictions = client_logits.argmax(dim=1)
    if routed.any():
        predictions[routed] = theta(channel.send("smashed", features[routed])).argmax(dim=1)
    return predictions, routed


# --- per-client views -------------------------------------------------------------------------------
def main_classes(labels: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return np.unique(labels[indices])


def nested_view(labels: np.ndarray, pool: np.ndarray, main: np.ndarray, max_rho: float,
                rng: np.random.Generator, main_cap: int | None = None) -> tuple[np.ndarray, int]:
    """Indices: the pool's main-class samples (at most `main_cap`, seeded), then out-of-distribution
    ones in a seeded order, enough for `max_rho`; and the number of main samples. The view for
    rho is the first n_main + round(rho * n_main) indices."""
    in_main = np.isin(labels[pool], main)
    mains, others = pool[in_main], rng.permutation(pool[~in_main])
    if main_cap is not None and len(mains) > main_cap:
        mains = np.sort(rng.choice(mains, main_cap, replace=False))
    need = round(max_rho * len(mains))
    if need > len(others):
        raise UserError(f"rho={max_rho} needs {need} out-of-distribution samples but a client has only "
                        f"{len(others)}; use a smaller rho")
    return np.concatenate([mains, others[:need]]), len(mains)


def view_size(n_main: int, rho: float) -> int:
    return n_main + round(rho * n_main)


@dataclass
class ClientOutputs:
    """One client's logits over its nested view, at both exits (None where an exit does not exist)."""

    labels: torch.Tensor
    n_main: int
    client_logits: torch.Tensor | None
    server_logits: torch.Tensor


def _accuracy(outputs: list[ClientOutputs], rho: float, threshold: float | None) -> tuple[float, float, int]:
    """(mean client accuracy, fraction decided at the client, samples sent) for one rho and E_th;
    threshold None = the server exit only, inf = the client exit only."""
    accuracies, total, sent = [], 0, 0
    for out in outputs:
        n = view_size(out.n_main, rho)
        predictions = out.server_logits[:n].argmax(dim=1)
        routed = torch.ones_like(predictions, dtype=torch.bool)
        if threshold is not None:
            routed = to_server(out.client_logits[:n], threshold)
            predictions = torch.where(routed, predictions, out.client_logits[:n].argmax(dim=1))
        accuracies.append(float((predictions == out.labels[:n]).float().mean()))
        total, sent = total + n, sent + int(routed.sum())
    return float(np.mean(accuracies)), 1 - sent / total, sent


def _pick_threshold(outputs: list[ClientOutputs], rho: float) -> float:
    """The grid's E_th with the best mean accuracy; ties go to the larger one (less traffic)."""
    scores = [(_accuracy(outputs, rho, t)[0], t) for t in ENTROPY_GRID]
    return max(scores)[1]


# --- running it on a finished run -------------------------------------------------------------------
def load_run(run_dir: str | Path, device: str = "cpu") -> Experiment:
    """Rebuild a finished run (data, clients, models) and load its final weights."""
    path = Path(run_dir)
    if not (path / "summary.json").is_file():
        raise UserError(f"{str(path)!r} holds no finished run (no summary.json); finish it with resume=true")
    raw = yaml.safe_load((path / "config.yaml").read_text())
    # Held-out views draw from every training sample outside a client's own, not just the run's.
    experiment = build({**raw, "device": device, "out": str(path)}, all_train_samples=True)
    algorithm = experiment.algorithm
    parts = algorithm.global_parts()
    if parts is not None:
        weights = load_file(path / "weights.safetensors", device=device)
        for part in parts:
            part.load_state_dict({name: weights[name] for name in part.state_dict()})
    if isinstance(algorithm, SplitGP):
        algorithm.load_client_weights(load_file(path / "clients.safetensors", device=device))
    elif parts is None:
        raise UserError(f"{raw['algorithm']!r} runs keep no model that evaluate can read; "
                        f"use a splitgp run or one with a global model (e.g. fedavg)")
    for module in algorithm.modules():
        module.eval()
    return experiment


def _views(experiment: Experiment, settings: EvaluationSettings, test: bool) -> list[tuple[np.ndarray, int]]:
    """Each client's nested view over the test set, or over the held-out training samples."""
    data, max_rho = experiment.data, max(settings.rho)
    labels = (data.test_y if test else data.train_y).cpu().numpy()
    train_labels = data.train_y.cpu().numpy()
    views = []
    for client in experiment.clients:
        own = client.indices.cpu().numpy()
        main = main_classes(train_labels, own)
        if test:
            pool, cap, stream = np.arange(len(labels)), None, _STREAM_VIEW
        else:
            pool, cap, stream = np.setdiff1d(np.arange(len(labels)), own), settings.validation_size, _STREAM_VALIDATION
        rng = experiment.algorithm.ctx.rng(0, stream, client.id)
        views.append(nested_view(labels, pool, main, max_rho, rng, cap))
    return views


@torch.no_grad()
def _splitgp_outputs(experiment: Experiment, views, x: torch.Tensor, y: torch.Tensor) -> list[ClientOutputs]:
    gp: SplitGP = experiment.algorithm
    outputs = []
    for k, (indices, n_main) in enumerate(views):
        features = logits_in_batches(gp.client_models[k], x[indices])
        outputs.append(ClientOutputs(y[indices], n_main, gp.exits[k](features),
                                     logits_in_batches(gp.server_model, features)))
    return outputs


def _finetuned(experiment: Experiment, rounds: int) -> list[nn.Module]:
    """Per client: the global model after `rounds` local updates (FedAvg's, never averaged)."""
    algorithm, cfg = experiment.algorithm, experiment.config.run
    global_model = nn.Sequential(*algorithm.global_parts())
    models = []
    for client in experiment.clients:
        model = copy.deepcopy(global_model).train()
        part = algorithm.ctx.part(model)
        for rnd in range(cfg.rounds, cfg.rounds + rounds):
            for x, y in algorithm.ctx.batches(client, rnd):
                algorithm.local_step(part, x, y)
        models.append(model.eval())
    return models


def evaluate_run(run_dir: str | Path, raw: dict) -> dict[str, Any]:
    """The Table II view of a finished run; also written to RUN_DIR/evaluation.json."""
    settings = parse_settings(EvaluationSettings, raw)
    experiment = load_run(run_dir, settings.device)
    data, rhos = experiment.data, settings.rho
    test_views = _views(experiment, settings, test=True)
    rows: dict[str, dict[str, list]] = {}

    def add(name: str, outputs: list[ClientOutputs], thresholds: list[float | None]) -> None:
        results = [_accuracy(outputs, rho, t) for rho, t in zip(rhos, thresholds)]
        rows[name] = {"accuracy": [r[0] for r in results], "client_fraction": [r[1] for r in results],
                      "samples_sent": [r[2] for r in results],
                      "entropy_threshold": [t if t is not None and math.isfinite(t) else None for t in thresholds]}

    if isinstance(experiment.algorithm, SplitGP):
        test = _splitgp_outputs(experiment, test_views, data.test_x, data.test_y)
        if settings.entropy_threshold == "auto":
            held_out = _splitgp_outputs(experiment, _views(experiment, settings, test=False),
                                        data.train_x, data.train_y)
            chosen = [_pick_threshold(held_out, rho) for rho in rhos]
        else:
            chosen = [float(settings.entropy_threshold)] * len(rhos)
        add("splitgp", test, chosen)
        add("client model", test, [float("inf")] * len(rhos))
        add("full model", test, [None] * len(rhos))
        add("splitgp (E_th chosen on test)", test, [_pick_threshold(test, rho) for rho in rhos])
        with torch.no_grad():
            cut_size = experiment.algorithm.client_average(data.test_x[:1]).numel()
        for row in rows.values():
            row["bytes_sent"] = [n * cut_size * data.test_x.element_size() for n in row["samples_sent"]]
    else:
        global_logits = logits_in_batches(experiment.algorithm.predict, data.test_x)
        add("generalized", [ClientOutputs(data.test_y[i], n, None, global_logits[i]) for i, n in test_views],
            [None] * len(rhos))
        if settings.finetune_rounds > 0:
            models = _finetuned(experiment, settings.finetune_rounds)
            outputs = [ClientOutputs(data.test_y[i], n, None, logits_in_batches(model, data.test_x[i]))
                       for model, (i, n) in zip(models, test_views)]
            add("personalized", outputs, [None] * len(rhos))
        for row in rows.values():  # the whole model runs at the client: nothing is sent
            row.update(client_fraction=[1.0] * len(rhos), samples_sent=[0] * len(rhos),
                       bytes_sent=[0] * len(rhos))
    result = {"run": str(run_dir), "algorithm": experiment.config.run.algorithm,
              "settings": settings.model_dump(), "rho": rhos, "rows": rows}
    write_json(Path(run_dir) / "evaluation.json", result)
    return result
