"""Trackers beside metrics.jsonl (which is always written): `logger=csv|tensorboard|mlflow|wandb`.

Each is a loop callback that logs every evaluated round's metrics, and with log_every=N every
N training steps' row (`splitlab.callbacks.StepLog`) under `train/` (csv: OUT/steps.csv; W&B
leaves them out: its one step axis counts rounds). csv is built in; the others
need their package (the extras `tensorboard`, `mlflow`, `wandb`), imported only when chosen, and
write under the run directory without a server or an account: TensorBoard to OUT/tensorboard,
MLflow to the file store OUT/mlruns, W&B offline to OUT/wandb (`wandb sync` uploads it later).
"""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path
from typing import Any

from splitlab.callbacks import Callback, State
from splitlab.errors import UserError
from splitlab.io import write_text
from splitlab.units import GIB

SCALARS = ("test_accuracy", "test_loss", "test_f1", "test_mcc", "test_perplexity", "train_loss", "comm_gib")

#: logger -> the package it imports (and the extra that installs it)
PACKAGES = {"tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb"}


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_logger(name: str) -> None:
    """Fail before anything is written when the chosen logger cannot work here."""
    package = PACKAGES.get(name)
    if package is not None and not installed(package):
        raise UserError(
            f"logger={name} needs the {package} package (pip install 'splitlab[{name}]'); "
            f"use logger=csv or logger=none to log to metrics.jsonl only"
        )


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers a tracker plots from a metrics row: SCALARS and GiB sent by kind."""
    values = {key: float(row[key]) for key in SCALARS if row.get(key) is not None}
    values.update({f"comm_gib/{kind}": n / GIB for kind, n in row["comm_bytes_by_kind"].items()})
    return values


def step_scalars(row: dict[str, Any]) -> dict[str, float]:
    """The numbers a tracker plots from a row of `log_every`'s, under train/ (its step is row["step"])."""
    return {f"train/{key}": float(value) for key, value in row.items() if key != "step" and value is not None}


class CsvLogger(Callback):
    """OUT/metrics.csv: one row per evaluated round, nested values as `key/sub` columns; the whole
    file rewritten atomically from the loop's rows, so a resumed run's file is an uninterrupted one's."""

    def __init__(self, out: Path) -> None:
        self.path, self.steps_path = out / "metrics.csv", out / "steps.csv"

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        if state.get("step_rows"):  # log_every: OUT/steps.csv beside
            _write_csv(self.steps_path, state["step_rows"])
        if row is not None:
            _write_csv(self.path, [_flat(r) for r in state["metrics"]])


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(key for r in rows for key in r))
    text = io.StringIO()
    writer = csv.DictWriter(text, columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_text(path, text.getvalue())


def _flat(row: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            flat.update({f"{key}/{sub}": v for sub, v in value.items()})
        else:
            flat[key] = value if not isinstance(value, list) else " ".join(map(str, value))
    return flat


class TensorBoardLogger(Callback):
    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        if row is not None:
            for key, value in scalars(row).items():
                self.writer.add_scalar(key, value, row["round"])
            self.writer.flush()

    def on_steps(self, state: State, row: dict[str, Any]) -> None:
        for key, value in step_scalars(row).items():
            self.writer.add_scalar(key, value, row["step"])

    def on_run_end(self, state: State) -> None:
        self.writer.close()


class MlflowLogger(Callback):
    """One MLflow run per splitlab run, in the file store OUT/mlruns (no tracking server)."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        mlflow.set_tracking_uri((out / "mlruns").resolve().as_uri())
        self.run = mlflow.start_run(run_name=out.name)
        mlflow.log_params({key: str(value) for key, value in config.items()})

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        if row is not None:
            self.mlflow.log_metrics({k.replace("/", "."): v for k, v in scalars(row).items()}, step=row["round"])

    def on_steps(self, state: State, row: dict[str, Any]) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in step_scalars(row).items()}, step=row["step"])

    def on_run_end(self, state: State) -> None:
        self.mlflow.end_run()


class WandbLogger(Callback):
    """A W&B run in offline mode under OUT/wandb (no account, no network; `wandb sync` uploads it)."""

    def __init__(self, out: Path, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(mode="offline", dir=str(out), name=out.name, config=config, reinit=True)

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        if row is not None:
            self.run.log(scalars(row), step=row["round"])

    def on_run_end(self, state: State) -> None:
        self.run.finish()


def make_logger(name: str, out: Path, config: dict[str, Any]) -> Callback | None:
    """The tracker `logger=name` asks for; None for logger=none."""
    if name == "csv":
        return CsvLogger(out)
    if name == "tensorboard":
        return TensorBoardLogger(out)
    if name == "mlflow":
        return MlflowLogger(out, config)
    if name == "wandb":
        return WandbLogger(out, config)
    return None
