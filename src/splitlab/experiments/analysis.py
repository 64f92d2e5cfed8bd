"""Result rows (the columns of results.csv), seed groups, the target accuracy and the table layout.

Statistics: a table cell aggregates the finished runs whose configs differ only in `seed`
(and `out`). Every table and plot is computed from the same rows as `results.csv`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from splitlab.experiments.grid import check_target
from splitlab.experiments.runs import (
    CONFIG_COLUMNS,
    METRIC_COLUMNS,
    RunData,
    load_runs,
    num,
)
from splitlab.units import GIB, to_target

#: keys that never distinguish experiments: the seed, and how a run was run (config.RUN_CONTROL_KEYS)
_NOT_EXPERIMENT = ("seed", "out", "resume", "overwrite", "device")


#: keys that become table columns (the papers put datasets / partitions side by side)
_COLUMN_KEYS = ("dataset", "model", "partition")


_PREFERRED_ORDER = ("algorithm", "cut", "dataset", "model", "partition", "clients")


#: the default target is this fraction of the best accuracy any run reached
DEFAULT_TARGET_FRACTION = 0.8


def _result_row(run: RunData, target: float | None, config_cols: list[str]) -> dict:
    row: dict[str, Any] = {"run": run.name, "status": run.status}
    for key in config_cols:
        row[key] = run.config.get(key)
    for key in METRIC_COLUMNS:
        row[key] = None
    last = run.metrics[-1] if run.metrics else {}
    row["rounds_completed"] = int(last["round"]) if last else 0
    if run.status != "finished":
        return row
    s = run.summary or {}
    accs = [(num(m.get("test_accuracy")), int(m["round"])) for m in run.metrics]
    accs = [(a, r) for a, r in accs if a is not None]
    best = max(accs, key=lambda ar: (ar[0], -ar[1])) if accs else (None, None)

    def pick(key: str, fallback: Any) -> Any:
        value = s.get(key)
        return value if value is not None else fallback

    row["rounds_completed"] = pick("rounds_completed", row["rounds_completed"])
    row["final_accuracy"] = pick("final_accuracy", last.get("test_accuracy"))
    row["best_accuracy"] = pick("best_accuracy", best[0])
    row["best_round"] = pick("best_round", best[1])
    row["final_loss"] = pick("final_loss", last.get("test_loss"))
    row["final_f1"] = pick("final_f1", last.get("test_f1"))
    row["final_mcc"] = pick("final_mcc", last.get("test_mcc"))
    row["bleu"], row["rouge_l"] = s.get("bleu"), s.get("rouge_l")  # eval_generate's, at the end only
    row["total_bytes"] = pick("total_bytes", last.get("comm_bytes"))
    total_bytes = num(row["total_bytes"])
    total_gib = total_bytes / GIB if total_bytes is not None else None
    row["total_gib"] = pick("total_gib", last.get("comm_gib", total_gib))
    row["wall_seconds"] = pick("wall_seconds", last.get("wall_seconds"))
    row["stopped_by"] = s.get("stopped_by")
    row["target_accuracy"] = target
    row["rounds_to_target"], row["gib_to_target"] = to_target(run.metrics, target)
    for kind, nbytes in sorted((s.get("comm_bytes_by_kind") or last.get("comm_bytes_by_kind") or {}).items()):
        row[f"bytes_{kind}"] = nbytes
    return row


def hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return json.dumps(value, sort_keys=True, default=str)


def _experiment_key(config: dict) -> str:
    """Runs with the same key differ only in seed (and output directory, device, resume flags)."""
    return json.dumps({k: v for k, v in config.items() if k not in _NOT_EXPERIMENT}, sort_keys=True, default=str)


class Analysis:
    """Runs, their result rows, seed groups and the table layout of one sweep directory."""

    def __init__(self, sweep_dir: Path, target_accuracy: float | None):
        self.dir = sweep_dir
        self.runs, self.snapshot = load_runs(sweep_dir)
        self.axes: dict = self.snapshot.get("axes") or {}
        self.finished = [r for r in self.runs if r.status == "finished"]
        self.target, self.target_source = self._target(target_accuracy)

        varying = self._varying([r.config for r in self.runs if r.status != "pending"] or [r.config for r in self.runs])
        config_cols = list(CONFIG_COLUMNS) + [k for k in varying if k not in CONFIG_COLUMNS]
        self.rows = [_result_row(r, self.target, config_cols) for r in self.runs]
        kinds = sorted({k for row in self.rows for k in row if k.startswith("bytes_")})
        self.columns = ["run", "status", *config_cols, *METRIC_COLUMNS, *kinds]

        # seed groups of finished runs, in run order
        self.groups: dict[str, list[int]] = {}
        for i, run in enumerate(self.runs):
            if run.status == "finished":
                self.groups.setdefault(_experiment_key(run.config), []).append(i)
        self._layout()

    # ---- target accuracy
    def _target(self, explicit: float | None) -> tuple[float | None, str]:
        if explicit is not None:
            return check_target(explicit, "target accuracy (--target)"), "given with --target"
        from_file = (self.snapshot.get("report") or {}).get("target_accuracy")
        if from_file is not None:
            return check_target(from_file, "report.target_accuracy"), "from the sweep file"
        found = [num(r.summary.get("best_accuracy")) for r in self.finished if r.summary]
        found += [num(m.get("test_accuracy")) for r in self.finished for m in r.metrics]
        bests = [b for b in found if b is not None]
        if not bests or max(bests) <= 0:
            return None, "no finished runs"
        value = math.floor(DEFAULT_TARGET_FRACTION * max(bests) * 100 + 1e-9) / 100
        return max(value, 0.01), (
            f"default: {DEFAULT_TARGET_FRACTION:.0%} of the best accuracy any "
            f"run reached, rounded down to a whole percent; set it with --target"
        )

    # ---- layout
    def _key_order(self, keys: Iterable[str]) -> list[str]:
        axis_order = [k for k in self.axes if k in keys]
        rest = [k for k in _PREFERRED_ORDER if k in keys and k not in axis_order]
        rest += sorted(k for k in keys if k not in axis_order and k not in rest)
        return axis_order + rest

    @staticmethod
    def _varying(configs: list[dict]) -> list[str]:
        keys = {k for c in configs for k in c} - set(_NOT_EXPERIMENT)
        return sorted(k for k in keys if len({hashable(c.get(k)) for c in configs}) > 1)

    def values_in_order(self, key: str, values: Iterable[Any]) -> list[Any]:
        uniq: dict = {}
        for v in values:
            uniq.setdefault(hashable(v), v)
        axis = [hashable(v) for v in self.axes.get(key, [])]
        known = [uniq[h] for h in axis if h in uniq]
        rest = [v for h, v in uniq.items() if h not in axis]
        rest.sort(key=lambda v: (not isinstance(v, (int, float)), v if isinstance(v, (int, float)) else str(v)))
        return known + rest

    def _layout(self) -> None:
        group_configs = {g: self.runs[idx[0]].config for g, idx in self.groups.items()}
        varying = self._varying(list(group_configs.values()))
        if self.axes:  # the sweep's axes, in the sweep file's order
            desc = [k for k in self.axes if k not in _NOT_EXPERIMENT]
        else:  # fabricated or hand-made directories: whatever varies between experiments
            desc = self._key_order(varying)

        def label_of(cfg: dict, keys: list[str]) -> tuple:
            return tuple(hashable(cfg.get(k)) for k in keys)

        for extra in [k for k in varying if k not in desc]:  # make cells unique
            labels = [label_of(c, desc) for c in group_configs.values()]
            if len(set(labels)) == len(labels):
                break
            desc.append(extra)
        self.col_keys = [k for k in desc if k in _COLUMN_KEYS]
        row_keys = [k for k in desc if k not in _COLUMN_KEYS]
        if "algorithm" in row_keys:
            row_keys.remove("algorithm")
            row_keys.insert(0, "algorithm")
        self.row_keys = row_keys

        def combos(keys: list[str]) -> list[tuple]:
            present = {label_of(c, keys) for c in group_configs.values()}
            ordered: list[tuple] = [()]
            for _i, k in enumerate(keys):
                vals = self.values_in_order(k, [c.get(k) for c in group_configs.values()])
                ordered = [t + (hashable(v),) for t in ordered for v in vals]
            return [t for t in ordered if t in present]

        self.row_tuples = combos(self.row_keys)
        self.col_tuples = combos(self.col_keys)
        self.cells: dict[tuple[tuple, tuple], str] = {}
        for g, cfg in group_configs.items():
            self.cells[(label_of(cfg, self.row_keys), label_of(cfg, self.col_keys))] = g

    def row_label(self, row: tuple) -> str:
        if not self.row_keys:
            return "all runs"
        head, rest = row[0], list(zip(self.row_keys[1:], row[1:]))
        same_head = [r for r in self.row_tuples if r[0] == head]
        shown = [f"{k}={v}" for i, (k, v) in enumerate(rest, 1) if len({r[i] for r in same_head}) > 1]
        text = str(head) if self.row_keys[0] == "algorithm" else f"{self.row_keys[0]}={head}"
        return text + (f" ({', '.join(shown)})" if shown else "")

    def col_label(self, col: tuple) -> str:
        return ", ".join(str(v) for v in col) if col else "all"

    def group_rows(self, group: str) -> list[dict]:
        return [self.rows[i] for i in self.groups[group]]

    def group_runs(self, group: str) -> list[RunData]:
        return [self.runs[i] for i in self.groups[group]]
