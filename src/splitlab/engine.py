"""The round loop every algorithm shares: sampling, evaluation, logging, checkpoints and resume.

`run(config)` validates everything and builds the whole experiment before it writes a byte, so a
bad setting never leaves a half-made run directory. Every random choice is drawn from a stream
keyed by (seed, round, purpose), and the checkpoint written after every round holds all state
that outlives a round, so a killed run resumed from its checkpoint ends bit for bit where an
uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from splitlab.algorithms import get_algorithm
from splitlab.algorithms.base import STREAM_SAMPLING, Algorithm, Context
from splitlab.channel import GIB, Channel
from splitlab.config import (
    RUN_CONTROL_KEYS,
    ResolvedConfig,
    parse_test_split,
    resolve_config,
)
from splitlab.data import Dataset, load_dataset, partition, partition_report
from splitlab.errors import UserError
from splitlab.io import (
    save_safetensors,
    save_torch,
    write_json,
    write_jsonl,
    write_yaml,
)
from splitlab.loggers import check_logger, make_logger
from splitlab.metrics import classification_metrics, logits_in_batches
from splitlab.roles import Client

RUN_FILES = ("config.yaml", "partition.json", "metrics.jsonl", "summary.json", "checkpoint.pt",
             "weights.safetensors", "clients.safetensors")


@dataclasses.dataclass
class Experiment:
    """A fully built run, nothing written yet."""

    config: ResolvedConfig
    data: Dataset
    clients: list[Client]
    algorithm: Algorithm
    partition_report: dict
    client_test: list[torch.Tensor] | None = None  # test_split=client: each client's held-out indices

    @property
    def out(self) -> Path:
        return self.config.out_dir

    @functools.cached_property
    def client_test_inputs(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """test_split=client: (client id, model inputs, labels) of every client's held-out samples,
        prepared once for all evaluations."""
        return [(c.id, self.data.train_x[idx], self.data.train_y[idx])
                for c, idx in zip(self.clients, self.client_test) if len(idx)]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("device 'cuda' was asked for but no CUDA GPU is available; use device=cpu or auto")
    return torch.device(name)


def _seeded_subset(size: int, subset: int | None, seed: int, what: str) -> np.ndarray:
    """Sorted indices of a seeded choice of `subset` out of `size` samples (all if None)."""
    if subset is None:
        return np.arange(size)
    if subset > size:
        raise UserError(f"{what}={subset} is more than the {size} samples the dataset has")
    return np.sort(np.random.default_rng([seed, size]).choice(size, subset, replace=False))


def _client_indices(config: ResolvedConfig, data: Dataset) -> list[np.ndarray]:
    run = config.run
    if run.clients == "all":
        if data.train_groups is None:
            raise UserError(f"clients=all needs a dataset with natural users; {run.dataset!r} has none")
        return [np.sort(group) for group in data.train_groups]
    # With natural users, only their samples are drawn (Shakespeare's windows straddling two roles
    # belong to nobody); otherwise all of them.
    users = np.arange(len(data.train_y)) if data.train_groups is None else np.sort(np.concatenate(data.train_groups))
    pool = users[_seeded_subset(len(users), run.train_subset, run.seed, "train_subset")]
    parts = partition(data.train_y.numpy()[pool], run.clients, run.partition, run.seed)
    return [pool[part] for part in parts]


def _hold_out(indices: list[np.ndarray], fraction: float, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Sample-wise train/test split of every client (as LEAF's `split_data.py --by_sample`): a seeded
    choice of n - max(1, int((1 - fraction) * n)) of its samples is held out, at least one kept."""
    train, test = [], []
    for k, idx in enumerate(indices):
        n_test = len(idx) - max(1, int((1 - fraction) * len(idx)))
        held = np.zeros(len(idx), dtype=bool)
        held[np.random.default_rng([seed, k, len(idx)]).choice(len(idx), n_test, replace=False)] = True
        train.append(idx[~held])
        test.append(idx[held])
    return train, test


def build(raw: Mapping[str, Any], *, all_train_samples: bool = False) -> Experiment:
    """Validate the config and build data, clients and algorithm; raises UserError on bad input.

    The experiment holds only the training samples its clients own (in their stored dtype) and the
    test samples it evaluates on; `all_train_samples=True` keeps every training sample (for
    evaluations that draw from samples outside the partition)."""
    config = resolve_config(raw)
    run = config.run
    device = resolve_device(run.device)
    check_logger(run.logger)
    data = load_dataset(run.dataset, run.data_dir, seed=run.seed)
    indices = _client_indices(config, data)
    held_out = parse_test_split(run.test_split)
    client_test = None
    if held_out is not None:
        indices, client_test = _hold_out(indices, held_out, run.seed)
    report = partition_report(data.train_y.numpy(), indices, data.num_classes)
    test = _seeded_subset(len(data.test_y), run.test_subset, run.seed, "test_subset")
    used = np.arange(len(data.train_y)) if all_train_samples else np.unique(np.concatenate([*indices, *(client_test or [])]))
    data, kept = data.for_run(used, test, device)
    indices = [np.searchsorted(kept, idx) for idx in indices]
    if client_test is not None:
        client_test = [np.searchsorted(kept, idx) for idx in client_test]
    clients = [Client(k, torch.as_tensor(idx, device=device)) for k, idx in enumerate(indices)]
    context = Context(run, config.params, data, clients, Channel(convention=run.ledger), device)
    context.new_model().client_stage_count(run.cut)  # a cut outside the model's range fails here
    algorithm = get_algorithm(run.algorithm)(context)
    if client_test is not None:
        client_test = [torch.as_tensor(idx, device=device) for idx in client_test]
    return Experiment(config, data, clients, algorithm, report, client_test)


def sample_clients(clients: list[Client], participation: float, rng: np.random.Generator) -> list[Client]:
    """round(C*K) clients (at least one), in id order."""
    count = max(1, round(participation * len(clients)))
    chosen = np.sort(rng.choice(len(clients), count, replace=False))
    return [clients[k] for k in chosen]


@contextlib.contextmanager
def eval_mode(algorithm: Algorithm) -> Iterator[None]:
    modules = algorithm.modules()
    modes = [m.training for m in modules]
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, modes):
            m.train(mode)


def evaluate(experiment: Experiment) -> dict[str, float]:
    """Test metrics. With test_split=client, every client's model is run on its own held-out
    samples and the metrics are computed on all of them pooled (accuracy and loss are then the
    test-size-weighted means of the per-client values). On the global test set, algorithms with
    personal client models get the unweighted mean over clients of each client's model's metrics."""
    data, algorithm = experiment.data, experiment.algorithm
    with eval_mode(algorithm):
        if experiment.client_test is not None:
            held = experiment.client_test_inputs
            logits = torch.cat([logits_in_batches(functools.partial(algorithm.predict_for_client, k), x)
                                for k, x, _ in held])
            return classification_metrics(logits, torch.cat([y for _, _, y in held]))
        if algorithm.personal_models:
            per_client = [classification_metrics(logits_in_batches(
                functools.partial(algorithm.predict_for_client, c.id), data.test_x), data.test_y)
                for c in experiment.clients]
            return {key: float(np.mean([m[key] for m in per_client])) for key in per_client[0]}
        logits = logits_in_batches(algorithm.predict, data.test_x)
    return classification_metrics(logits, data.test_y)


class _RunDirectory:
    """The run's files, and the rules for starting, resuming or replacing them."""

    def __init__(self, experiment: Experiment) -> None:
        self.path = experiment.out
        self.config = experiment.config

    def existing(self) -> list[str]:
        return [name for name in RUN_FILES if (self.path / name).exists()]

    def check_resumable(self) -> None:
        # A key the stored config lacks (added to splitlab after the run began) counts as its default.
        stored = {**self.config.defaults(), **(yaml.safe_load((self.path / "config.yaml").read_text()) or {})}
        current = self.config.as_dict()
        differing = sorted(k for k in current if k not in RUN_CONTROL_KEYS and stored.get(k) != current[k])
        if differing:
            key = differing[0]
            raise UserError(f"cannot resume {str(self.path)!r}: {key}={current[key]!r} differs from the "
                            f"stored {stored.get(key)!r}; use overwrite=true to start over")

    def clear(self) -> None:
        for name in RUN_FILES:
            (self.path / name).unlink(missing_ok=True)


def run(config: Mapping[str, Any], *, resume: bool | None = None, progress: bool = True) -> dict[str, Any]:
    """Run (or resume) one experiment; returns the summary that is also written to summary.json."""
    experiment = build(config)
    run_config = experiment.config.run
    resume = run_config.resume if resume is None else resume
    directory = _RunDirectory(experiment)
    existing = directory.existing()
    if existing and run_config.overwrite:
        directory.clear()
    elif existing and not resume:
        raise UserError(f"out {str(directory.path)!r} already holds a run; use resume=true to continue it "
                        f"or overwrite=true to replace it")
    elif existing and "config.yaml" in existing:
        directory.check_resumable()
        if "summary.json" in existing:
            return json.loads((directory.path / "summary.json").read_text())
    return _loop(experiment, progress)


def _loop(experiment: Experiment, show_progress: bool) -> dict[str, Any]:
    cfg = experiment.config.run
    algorithm, out = experiment.algorithm, experiment.out
    ledger = algorithm.channel.ledger
    checkpoint_path = out / "checkpoint.pt"
    state: dict[str, Any] = {"round": 0, "metrics": [], "wall_seconds": 0.0, "stopped_by": "rounds"}
    if checkpoint_path.exists():
        checkpoint = torch.load(checkpoint_path, map_location=experiment.data.train_x.device, weights_only=True)
        algorithm.load_state_dict(checkpoint.pop("algorithm"))
        ledger.load_state_dict(checkpoint.pop("ledger"))
        state = checkpoint
    else:
        write_yaml(out / "config.yaml", experiment.config.as_dict())
        write_json(out / "partition.json", experiment.partition_report)

    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("acc {task.fields[acc]}  {task.fields[gib]} GiB"), TimeElapsedColumn()]
    logger = make_logger(cfg.logger, out)
    with Progress(*columns, disable=not show_progress, transient=False) as bar:
        task = bar.add_task(f"{cfg.algorithm} rounds", total=cfg.rounds, completed=state["round"],
                            acc=_last_accuracy(state["metrics"]), gib=f"{ledger.total_bytes / GIB:.3f}")
        while state["round"] < cfg.rounds and state["stopped_by"] == "rounds":
            rnd = state["round"]
            torch.manual_seed(cfg.seed * 1_000_003 + rnd)  # dropout etc. depend on (seed, round) only
            clients = sample_clients(experiment.clients, cfg.participation,
                                     algorithm.ctx.rng(rnd, STREAM_SAMPLING))
            started = time.perf_counter()
            algorithm.train_round(rnd, clients)
            train_loss = algorithm.pop_train_loss()
            compute_seconds = algorithm.pop_compute_seconds()
            state["wall_seconds"] += time.perf_counter() - started
            state["round"] = rnd + 1
            over_budget = cfg.comm_budget_gib is not None and ledger.total_bytes >= cfg.comm_budget_gib * GIB
            if over_budget:
                state["stopped_by"] = "comm_budget"
            if state["round"] % cfg.eval_every == 0 or state["round"] == cfg.rounds or over_budget:
                state["metrics"].append(_metrics_row(experiment, state, train_loss, compute_seconds))
                write_jsonl(out / "metrics.jsonl", state["metrics"])
                logger.log(state["metrics"][-1])
            save_torch(checkpoint_path, {**state, "algorithm": algorithm.state_dict(),
                                         "ledger": ledger.state_dict()})
            bar.update(task, completed=state["round"], acc=_last_accuracy(state["metrics"]),
                       gib=f"{ledger.total_bytes / GIB:.3f}")
    logger.close()
    return _finish(experiment, state)


def _last_accuracy(rows: list[dict]) -> str:
    return f"{100 * rows[-1]['test_accuracy']:.2f}%" if rows else "-"


def _metrics_row(experiment: Experiment, state: dict, train_loss: float | None,
                 compute_seconds: dict[str, float]) -> dict[str, Any]:
    ledger = experiment.algorithm.channel.ledger
    test = evaluate(experiment)
    return {
        "round": state["round"],
        "test_accuracy": test["accuracy"],
        "test_loss": test["loss"],
        "test_f1": test["f1"],
        "test_mcc": test["mcc"],
        "train_loss": train_loss,
        "comm_bytes": ledger.total_bytes,
        "comm_gib": ledger.total_bytes / GIB,
        "comm_bytes_by_kind": ledger.state_dict(),
        "wall_seconds": state["wall_seconds"],
        "round_compute_seconds": compute_seconds,
    }


def _to_target(rows: list[dict], target: float | None) -> dict[str, Any]:
    """First evaluated round whose test accuracy reaches `target`, and the GiB sent by then
    (both None if it never did, or no target was set). Only evaluated rounds count (eval_every)."""
    hit = next((row for row in rows if target is not None and row["test_accuracy"] >= target), None)
    return {"target_accuracy": target, "rounds_to_target": hit and hit["round"],
            "gib_to_target": hit and hit["comm_gib"]}


def _finish(experiment: Experiment, state: dict) -> dict[str, Any]:
    cfg, out = experiment.config.run, experiment.out
    rows = state["metrics"]
    best = max(rows, key=lambda row: row["test_accuracy"])
    ledger = experiment.algorithm.channel.ledger
    summary = {
        "algorithm": cfg.algorithm, "dataset": cfg.dataset, "model": cfg.model, "cut": cfg.cut,
        "seed": cfg.seed, "partition": cfg.partition, "clients": len(experiment.clients),
        "rounds_completed": state["round"],
        "final_accuracy": rows[-1]["test_accuracy"], "best_accuracy": best["test_accuracy"],
        "best_round": best["round"], "final_loss": rows[-1]["test_loss"],
        "final_f1": rows[-1]["test_f1"], "final_mcc": rows[-1]["test_mcc"],
        "total_bytes": ledger.total_bytes, "total_gib": ledger.total_bytes / GIB,
        "comm_bytes_by_kind": ledger.state_dict(),
        "wall_seconds": state["wall_seconds"], "stopped_by": state["stopped_by"],
        **_to_target(rows, cfg.target_accuracy),
    }
    parts = experiment.algorithm.global_parts()
    if parts is not None:
        weights = {name: t for part in parts for name, t in part.state_dict().items()}
        save_safetensors(out / "weights.safetensors", weights)
    client_weights = experiment.algorithm.client_weights()
    if client_weights is not None:
        save_safetensors(out / "clients.safetensors", client_weights)
    write_json(out / "summary.json", summary)
    (out / "checkpoint.pt").unlink(missing_ok=True)
    return summary
