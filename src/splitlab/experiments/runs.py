"""Loading a sweep directory's runs: config.yaml, summary.json, metrics.jsonl, partition.json.

A run is finished (summary.json), incomplete, failed (error.txt), pending (planned in sweep.yaml,
not started) or unreadable: its summary.json or metrics.jsonl is truncated, garbage or not strict
JSON, and no number from it may reach a table or plot.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from splitlab.experiments.sweep import ERROR_FILE, SNAPSHOT
from splitlab.json_text import MAX_FILE_DEPTH, check_depth
from splitlab.rundir import CHECKPOINT

#: config columns that results.csv always has (plus any other key that varies between runs)
CONFIG_COLUMNS = ("algorithm", "dataset", "model", "cut", "partition", "clients", "seed")


#: metric columns of results.csv, then one `bytes_<kind>` column per message kind
METRIC_COLUMNS = (
    "rounds_completed",
    "final_accuracy",
    "best_accuracy",
    "best_round",
    "final_loss",
    "final_f1",
    "final_mcc",
    "bleu",
    "rouge_l",
    "total_bytes",
    "total_gib",
    "wall_seconds",
    "stopped_by",
    "target_accuracy",
    "rounds_to_target",
    "gib_to_target",
)


@dataclass
class RunData:
    name: str
    path: Path
    status: str  # finished | incomplete | failed | unreadable | pending
    config: dict
    summary: dict | None = None
    metrics: list[dict] = field(default_factory=list)
    partition: dict | None = None
    error: str | None = None


def _read_json(path: Path) -> Any:
    try:
        return _strict_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not strict JSON")


def _strict_json(text: str) -> Any:
    check_depth(text, MAX_FILE_DEPTH)
    return json.loads(text, parse_constant=_no_constants)


def _read_summary(path: Path) -> tuple[dict | None, str | None]:
    """(summary, None); (None, None) when there is none; (None, why) when it is unreadable."""
    if not path.exists():
        return None, None
    try:
        value = _strict_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path.name} cannot be read ({e.__class__.__name__})"
    except ValueError as e:
        return None, f"{path.name} is not valid JSON ({str(e).splitlines()[0]}); truncated or corrupt"
    if not isinstance(value, dict):
        return None, f"{path.name} is not a JSON object"
    bad = [
        k for k in METRIC_COLUMNS if k in value and value[k] is not None and k != "stopped_by" and num(value[k]) is None
    ]
    if bad:
        return None, f"{path.name} has non-numeric {', '.join(bad)}"
    return value, None


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError, RecursionError):
        return None


def _read_metrics(path: Path, finished: bool) -> tuple[list[dict], str | None]:
    """metrics.jsonl rows sorted by round (a round logged twice, by a resume, keeps its last row),
    and why the file is unreadable, if it is. A torn last line is what a killed or running run
    leaves, so it is skipped unless the run has finished; any other bad line makes it unreadable."""
    by_round: dict[int, dict] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return [], None
    except (OSError, UnicodeDecodeError) as e:
        return [], f"{path.name} cannot be read ({e.__class__.__name__})"
    numbered = [(i, line.strip()) for i, line in enumerate(lines, 1) if line.strip()]
    for pos, (number, line) in enumerate(numbered):
        try:
            row = _strict_json(line)
        except ValueError:
            if pos == len(numbered) - 1 and not finished:
                continue  # a torn last line
            return [], f"{path.name} line {number} is not valid JSON; truncated or corrupt"
        if not (isinstance(row, dict) and num(row.get("round")) is not None):
            return [], f"{path.name} line {number} is not a metrics row (no round number)"
        by_round[int(row["round"])] = row
    return [by_round[r] for r in sorted(by_round)], None


def _load_run(path: Path, planned: dict | None) -> RunData:
    summary, summary_problem = _read_summary(path / "summary.json")
    config = _read_yaml(path / "config.yaml")
    if not isinstance(config, dict):
        config = {}
        for key in CONFIG_COLUMNS:  # fall back on what the summary says
            if isinstance(summary, dict) and key in summary:
                config[key] = summary[key]
        config.update(planned or {})
    finished = summary is not None or summary_problem is not None
    metrics, metrics_problem = _read_metrics(path / "metrics.jsonl", finished)
    problems = [p for p in (summary_problem, metrics_problem) if p]
    if problems:  # no number from this run reaches a table or plot
        return RunData(path.name, path, "unreadable", config, None, [], None, "; ".join(problems))
    partition = _read_json(path / "partition.json")
    error = None
    if summary is not None:
        status = "finished"
    elif (path / ERROR_FILE).is_file():
        status = "failed"
        error = (path / ERROR_FILE).read_text(encoding="utf-8", errors="replace")
    else:
        status = "incomplete"
    return RunData(
        path.name, path, status, config, summary, metrics, partition if isinstance(partition, dict) else None, error
    )


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and any(
        (path / f).exists() for f in ("config.yaml", "summary.json", "metrics.jsonl", CHECKPOINT, ERROR_FILE)
    )


def load_runs(sweep_dir: Path) -> tuple[list[RunData], dict]:
    """The runs of a sweep directory, or the one run a run directory holds."""
    if _is_run_dir(sweep_dir) and not (sweep_dir / SNAPSHOT).exists():
        return [_load_run(sweep_dir, None)], {}
    snapshot = _read_yaml(sweep_dir / SNAPSHOT)
    snapshot = snapshot if isinstance(snapshot, dict) else {}
    planned: dict = snapshot.get("runs") or {}
    runs = {p.name: _load_run(p, planned.get(p.name)) for p in sorted(sweep_dir.iterdir()) if _is_run_dir(p)}
    for name, point in planned.items():
        if name not in runs:
            runs[name] = RunData(name, sweep_dir / name, "pending", dict(point or {}))
    order = {n: i for i, n in enumerate(planned)}
    ordered = sorted(runs.values(), key=lambda r: (order.get(r.name, len(order)), r.name))
    return ordered, snapshot


def num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
