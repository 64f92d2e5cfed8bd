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

A SplitGP run is evaluated through its roles: its weights go back into the client nodes (phi_k,
h_k), the sync server and the training server (theta); each client runs phi_k and h_k on its view
(`infer`), its entropy gate sends the features of the samples it routes (`route`, ledger kind
`smashed`) and the server answers those with theta. `bytes_sent` is what the experiment's ledger
counted for each row and rho. The training set (for the validation views and the fine-tuning
baseline) is rebuilt exactly as the run's engine partitioned it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator
from torch import nn

from splitlab import rundir
from splitlab.algorithms.splitgp import SplitGP, entropy, to_server
from splitlab.assembly import Experiment
from splitlab.config import parse_settings, parse_test_split
from splitlab.data import load_dataset
from splitlab.data.datasets import Prepared
from splitlab.errors import UserError
from splitlab.finished_run import check_columns_in_one_process, final_states, global_states, load_run
from splitlab.io import write_json
from splitlab.models import joined, split
from splitlab.random_streams import register_stream
from splitlab.roles import ClientNode, State
from splitlab.settings import stored_setting
from splitlab.settings.horizontal import client_indices, hold_out

__all__ = [
    "ENTROPY_GRID",
    "EvaluationSettings",
    "entropy",
    "to_server",
    "gated_predict",
    "training_set",
    "nested_view",
    "evaluate_run",
]

#: The paper's candidate entropy thresholds (Section VI).
ENTROPY_GRID = (0.05, 0.1, 0.2, 0.4, 0.8, 1.2, 1.6, 2.3)
STREAM_VIEW = register_stream("splitgp.evaluation.view", 10)
STREAM_VALIDATION = register_stream("splitgp.evaluation.validation", 11)


class EvaluationSettings(BaseModel):
    """The `splitlab evaluate` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    rho: list[float] = Field([0, 0.2, 0.4, 0.6, 0.8], description="out-of-distribution fractions")
    entropy_threshold: Annotated[float, Field(ge=0, le=1e18)] | str = Field(
        "auto", description="E_th, or auto (chosen per rho on held-out data)"
    )
    validation_size: int = Field(
        200, ge=1, le=10_000_000, description="main-class held-out samples per client for auto"
    )
    finetune_rounds: int = Field(1, ge=0, le=100_000, description="local updates for the personalized baseline")
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


# --- the entropy gate (Algorithm 1, inference phase), through the transport -------------------------
def gated_predict(
    experiment: Experiment, client_id: int, client_logits: torch.Tensor, n: int, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions of client `client_id`'s deployed SplitGP on the first n samples of its last `infer`
    (whose client-exit logits are `client_logits`), and which samples the server decided: the gate's
    routed features reach the server through the transport (ledger kind `smashed`)."""
    algorithm = experiment.algorithm
    sent = algorithm.client(client_id).route(n, threshold)
    routed = sent["evaluation"]
    predictions = client_logits[:n].argmax(dim=1)
    if routed.any():
        predictions[routed] = algorithm.server.infer(sent["smashed"]).argmax(dim=1)
    return predictions, routed


# --- per-client views -------------------------------------------------------------------------------
def main_classes(labels: np.ndarray, indices: np.ndarray) -> np.ndarray:
    return np.unique(labels[indices])


def nested_view(
    labels: np.ndarray,
    pool: np.ndarray,
    main: np.ndarray,
    max_rho: float,
    rng: np.random.Generator,
    main_cap: int | None = None,
    who: str = "a client",
    partition: str | None = None,
) -> tuple[np.ndarray, int]:
    """Indices: the pool's main-class samples (at most `main_cap`, seeded), then out-of-distribution
    ones in a seeded order, enough for `max_rho`; and the number of main samples. The view for
    rho is the first n_main + round(rho * n_main) indices."""
    in_main = np.isin(labels[pool], main)
    mains, others = pool[in_main], rng.permutation(pool[~in_main])
    if main_cap is not None and len(mains) > main_cap:
        mains = np.sort(rng.choice(mains, main_cap, replace=False))
    need = round(max_rho * len(mains))
    if need > len(others):
        raise UserError(_rho_unmet(max_rho, need, len(others), len(mains), len(main), who, partition))
    return np.concatenate([mains, others[:need]]), len(mains)


def _rho_unmet(rho: float, need: int, have: int, n_main: int, n_classes: int, who: str, partition: str | None) -> str:
    """One line: why rho cannot be met on this partition, and what to do."""
    on = f" on partition={partition}" if partition else ""
    if have == 0:
        return (
            f"rho={rho:g} cannot be met{on}: {who} holds all {n_classes} classes, so no test sample is "
            f"out of its distribution (rho measures that); evaluate with rho=0, or train on a partition "
            f"that leaves classes out of each client (e.g. partition=shards:2 or dirichlet:0.1)"
        )
    most = math.floor(100 * have / n_main) / 100 if n_main else 0.0
    return (
        f"rho={rho:g} cannot be met{on}: it needs {need} out-of-distribution samples for {who}, which "
        f"has only {have} (beside {n_main} of its own classes); use rho <= {most:g}, or a partition "
        f"that leaves more classes out of each client (e.g. partition=shards:2)"
    )


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
            assert out.client_logits is not None, "a model without a client exit is not gated"
            routed = to_server(out.client_logits[:n], threshold)
            predictions = torch.where(routed, predictions, out.client_logits[:n].argmax(dim=1))
        accuracies.append(float((predictions == out.labels[:n]).float().mean()))
        total, sent = total + n, sent + int(routed.sum())
    return float(np.mean(accuracies)), 1 - sent / total, sent


def _pick_threshold(outputs: list[ClientOutputs], rho: float) -> float:
    """The grid's E_th with the best mean accuracy; ties go to the larger one (less traffic)."""
    scores = [(_accuracy(outputs, rho, t)[0], t) for t in ENTROPY_GRID]
    return max(scores)[1]


def _deployed(
    experiment: Experiment, outputs: list[ClientOutputs], rho: float, threshold: float | None
) -> tuple[float, float, int, int]:
    """`_accuracy` of the deployed system: every client gates its view for rho (after its `infer` on
    the whole view) and the server answers what it routes. Also the bytes of smashed data the
    experiment's ledger counted for it."""
    gate = -math.inf if threshold is None else threshold  # None: every sample goes to the server
    smashed_before = experiment.ledger.bytes_by_kind.get("smashed", 0)
    accuracies, total, sent = [], 0, 0
    for client, out in zip(experiment.clients, outputs):
        n = view_size(out.n_main, rho)
        assert out.client_logits is not None, "SplitGP's outputs have a client exit"
        predictions, routed = gated_predict(experiment, client.id, out.client_logits, n, gate)
        accuracies.append(float((predictions == out.labels[:n]).float().mean()))
        total, sent = total + n, sent + int(routed.sum())
    sent_bytes = experiment.ledger.bytes_by_kind.get("smashed", 0) - smashed_before
    return float(np.mean(accuracies)), 1 - sent / total, sent, sent_bytes


# --- running it on a finished run -------------------------------------------------------------------
@dataclass
class TrainingSet:
    """The run's training set and each client's samples in it, as the run's engine partitioned them
    (every training sample, those no client holds included: the validation views draw on them)."""

    x: torch.Tensor | Prepared
    y: torch.Tensor
    owned: list[np.ndarray]


def training_set(experiment: Experiment) -> TrainingSet:
    run = experiment.config.run
    data = load_dataset(run.dataset, run.data_dir, seed=run.seed)
    owned = client_indices(experiment.config, data)
    held_out = parse_test_split(run.test_split)
    if held_out is not None:
        owned, _ = hold_out(owned, held_out, run.seed)
    x = data.train_x if data.prepare is None else Prepared(data.train_x, data.prepare)  # prepared when indexed
    return TrainingSet(x, data.train_y, owned)


def _views(
    experiment: Experiment, train: TrainingSet, settings: EvaluationSettings, test: bool
) -> list[tuple[np.ndarray, int]]:
    """Each client's nested view over the test set, or over the training samples it does not hold."""
    max_rho = max(settings.rho)
    labels = (experiment.data.test_y if test else train.y).cpu().numpy()
    train_labels = train.y.cpu().numpy()
    views = []
    for client_id, own in enumerate(train.owned):
        main = main_classes(train_labels, own)
        if test:
            pool, cap, stream = np.arange(len(labels)), None, STREAM_VIEW
        else:
            pool, cap, stream = np.setdiff1d(np.arange(len(labels)), own), settings.validation_size, STREAM_VALIDATION
        rng = experiment.blueprint.rng(0, stream, client_id)
        views.append(
            nested_view(
                labels,
                pool,
                main,
                max_rho,
                rng,
                cap,
                who=f"client {client_id}",
                partition=str(experiment.config.run.partition),
            )
        )
    return views


def _splitgp_outputs(
    experiment: Experiment, views: list[tuple[np.ndarray, int]], x: torch.Tensor | Prepared, y: torch.Tensor
) -> list[ClientOutputs]:
    """Both exits on every client's whole view: the client runs `infer` on it (its features stay
    there for the rows' gating), and its gate with E_th = -inf sends all of them to the server."""
    algorithm, device = experiment.algorithm, experiment.blueprint.device
    outputs = []
    for client, (indices, n_main) in zip(experiment.clients, views):
        client_logits = algorithm.client(client.id).infer(x[indices].to(device))
        sent = algorithm.client(client.id).route(len(indices), -math.inf)
        outputs.append(
            ClientOutputs(y[indices].to(device), n_main, client_logits, algorithm.server.infer(sent["smashed"]))
        )
    return outputs


def _model(experiment: Experiment, states: list[State]) -> nn.Module:
    """A new module holding the global model `states` (the whole model, or client then server part)."""
    model = experiment.blueprint.new_model()
    run = experiment.config.run
    parts: list[nn.Module] = [model] if len(states) == 1 else list(split(model, run.cut, run.tail_cut))
    for part, state in zip(parts, states):
        part.load_state_dict(state)
    return joined(parts)


def _finetuned(experiment: Experiment, states: list[State], train: TrainingSet, rounds: int) -> list[nn.Module]:
    """Per client: the global model after `rounds` local updates (FedAvg's, never averaged), on the
    client's own samples in its own batch order (its node's, or, where the run's nodes are not the
    partition's clients, as centralized, a node holding that client's samples)."""
    blueprint, cfg = experiment.blueprint, experiment.config.run
    roles = experiment.roles
    nodes = roles.clients if roles is not None and len(roles.clients) == len(train.owned) else None
    models = []
    for client_id, own in enumerate(train.owned):
        node = (
            nodes[client_id]
            if nodes is not None
            else ClientNode(blueprint, client_id, train.x[own].to(blueprint.device), train.y[own].to(blueprint.device))
        )
        model = _model(experiment, states).train()
        optimizer = blueprint.optimizer(model)
        for rnd in range(cfg.rounds, cfg.rounds + rounds):
            for x, y in node.batches(rnd):
                optimizer.zero_grad(set_to_none=True)
                blueprint.loss(model(x), y).backward()
                optimizer.step()
        models.append(model.eval())
    return models


def evaluate_run(run_dir: str | Path, raw: dict) -> dict[str, Any]:
    """The Table II view of a finished run; also written to RUN_DIR/evaluation.json."""
    settings = parse_settings(EvaluationSettings, raw)
    path = Path(run_dir)
    stored = rundir.stored_config(path, "evaluate", "point evaluate at the directory of a finished run")
    if not stored_setting(stored).whole_samples:  # the setting reads its own (vertical: every party's columns)
        return _evaluate_vertical(path, stored, settings)
    experiment = load_run(run_dir, settings.device)
    data, rhos, train = experiment.data, settings.rho, training_set(experiment)
    test_views = _views(experiment, train, settings, test=True)
    rows: dict[str, dict[str, list]] = {}

    def add(name: str, results: list[tuple], thresholds: list[float | None]) -> None:
        rows[name] = {
            "accuracy": [r[0] for r in results],
            "client_fraction": [r[1] for r in results],
            "samples_sent": [r[2] for r in results],
            "entropy_threshold": [t if t is not None and math.isfinite(t) else None for t in thresholds],
        }
        if all(len(r) > 3 for r in results):
            rows[name]["bytes_sent"] = [r[3] for r in results]

    if isinstance(experiment.algorithm, SplitGP):
        if settings.entropy_threshold == "auto":
            held_out = _splitgp_outputs(experiment, _views(experiment, train, settings, test=False), train.x, train.y)
            chosen = [_pick_threshold(held_out, rho) for rho in rhos]
        else:
            chosen = [float(settings.entropy_threshold)] * len(rhos)
        test = _splitgp_outputs(experiment, test_views, data.test_x, data.test_y)  # last: the clients keep it
        on_test: list[float | None] = [_pick_threshold(test, rho) for rho in rhos]
        gated: list[tuple[str, list[float | None]]] = [
            ("splitgp", list(chosen)),
            ("client model", [math.inf] * len(rhos)),
            ("full model", [None] * len(rhos)),
            ("splitgp (E_th chosen on test)", on_test),
        ]
        for name, thresholds in gated:
            add(name, [_deployed(experiment, test, rho, t) for rho, t in zip(rhos, thresholds)], thresholds)
    elif experiment.algorithm.personal_models:  # each client's own model on its own view
        outputs = [
            ClientOutputs(
                data.test_y[i],
                n,
                None,
                experiment.blueprint.logits(experiment.assemble(final_states(experiment, k)), data.test_x[i]),
            )
            for k, (i, n) in enumerate(test_views)
        ]
        add("personal", [_accuracy(outputs, rho, None) for rho in rhos], [None] * len(rhos))
    else:
        states = global_states(experiment)
        global_logits = experiment.blueprint.logits(experiment.assemble(states), data.test_x)
        results = [
            _accuracy([ClientOutputs(data.test_y[i], n, None, global_logits[i]) for i, n in test_views], rho, None)
            for rho in rhos
        ]
        add("generalized", results, [None] * len(rhos))
        if settings.finetune_rounds > 0:
            models = _finetuned(experiment, states, train, settings.finetune_rounds)
            with torch.no_grad():
                outputs = [
                    ClientOutputs(
                        data.test_y[i],
                        n,
                        None,
                        experiment.blueprint.logits(model, data.test_x[i]),
                    )
                    for model, (i, n) in zip(models, test_views)
                ]
            add("personalized", [_accuracy(outputs, rho, None) for rho in rhos], [None] * len(rhos))
        for row in rows.values():  # the whole model runs at the client: nothing is sent
            row.update(client_fraction=[1.0] * len(rhos), samples_sent=[0] * len(rhos), bytes_sent=[0] * len(rhos))
    result = {
        "run": str(run_dir),
        "algorithm": experiment.config.run.algorithm,
        "settings": settings.model_dump(),
        "rho": rhos,
        "rows": rows,
    }
    write_json(Path(run_dir) / "evaluation.json", result)
    return result


def _evaluate_vertical(path: Path, stored: dict[str, Any], settings: EvaluationSettings) -> dict[str, Any]:
    """A vertical run's final model on the test set (its parties hold the same samples, so there
    are no per-client views to take); also written to RUN_DIR/evaluation.json."""
    from splitlab.settings.vertical import evaluate_vertical

    given = sorted(settings.model_fields_set - {"device"})
    if given:
        raise UserError(
            f"{given[0]}= does not apply to a vertical run: its parties hold the same samples, so there are no "
            f"per-client views; evaluate reports the final model's test metrics (device= only)"
        )
    if not (path / "summary.json").is_file():
        raise UserError(f"{str(path)!r} holds no finished run (no summary.json); finish it with resume=true")
    check_columns_in_one_process(
        stored,
        path,
        "evaluate",
        beside="",
        so=", so no process here holds them; its final test metrics, which the parties computed together, are in "
        "its summary.json",
    )
    result = {
        "run": str(path),
        "algorithm": stored.get("algorithm", "sl"),
        "setting": "vertical",
        "settings": settings.model_dump(),
        "metrics": evaluate_vertical(path, stored, settings.device),
    }
    write_json(path / "evaluation.json", result)
    return result
