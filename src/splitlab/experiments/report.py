"""Tables and plots from a sweep directory: `results.csv`, `report.md`, `plots/*.png`.

Works on whatever is in the directory: finished runs (with `summary.json`) make the tables and
plots; incomplete, failed and not-yet-started runs are listed. Every table is computed from the
same rows that are written to `results.csv`, so the two always agree.

Statistics: a table cell aggregates the finished runs whose configs differ only in `seed`
(and `out`); it shows mean ± sample standard deviation (ddof = 1). A cell with one seed shows
the value alone. Accuracies are shown in percent; `results.csv` keeps the engine's fractions.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from splitlab.comm import GIB, byte_unit, format_bytes, row_gib, to_target
from splitlab.errors import UserError
from splitlab.experiments.sweep import ERROR_FILE, SNAPSHOT, check_target
from splitlab.io import write_text

REPORT = "report.md"
RESULTS = "results.csv"
PLOTS = "plots"

#: config columns that results.csv always has (plus any other key that varies between runs)
CONFIG_COLUMNS = ("algorithm", "dataset", "model", "cut", "partition", "clients", "seed")
#: metric columns of results.csv, then one `bytes_<kind>` column per message kind
METRIC_COLUMNS = (
    "rounds_completed", "final_accuracy", "best_accuracy", "best_round", "final_loss",
    "final_f1", "final_mcc", "total_bytes", "total_gib", "wall_seconds", "stopped_by",
    "target_accuracy", "rounds_to_target", "gib_to_target",
)
#: keys that never distinguish experiments: the seed, and how a run was run (config.RUN_CONTROL_KEYS)
_NOT_EXPERIMENT = ("seed", "out", "resume", "overwrite", "device")
#: keys that become table columns (the papers put datasets / partitions side by side)
_COLUMN_KEYS = ("dataset", "model", "partition")
_PREFERRED_ORDER = ("algorithm", "cut", "dataset", "model", "partition", "clients")
#: the default target is this fraction of the best accuracy any run reached
DEFAULT_TARGET_FRACTION = 0.8
_FIXED_SHOWN = ("dataset", "model", "partition", "clients", "rounds", "local_epochs", "batch_size",
                "optimizer", "lr", "train_subset")


# --------------------------------------------------------------------------- loading


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
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not strict JSON")


def _strict_json(text: str) -> Any:
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
    bad = [k for k in METRIC_COLUMNS if k in value and value[k] is not None and k != "stopped_by"
           and _num(value[k]) is None]
    if bad:
        return None, f"{path.name} has non-numeric {', '.join(bad)}"
    return value, None


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
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
        if not (isinstance(row, dict) and _num(row.get("round")) is not None):
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
    return RunData(path.name, path, status, config, summary, metrics,
                   partition if isinstance(partition, dict) else None, error)


def _is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / f).exists() for f in
                                 ("config.yaml", "summary.json", "metrics.jsonl", "checkpoint.pt", ERROR_FILE))


def _load(sweep_dir: Path) -> tuple[list[RunData], dict]:
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


# --------------------------------------------------------------------------- per-run numbers


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


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
    accs = [(_num(m.get("test_accuracy")), int(m["round"])) for m in run.metrics]
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
    row["total_bytes"] = pick("total_bytes", last.get("comm_bytes"))
    total_gib = _num(row["total_bytes"]) / GIB if _num(row["total_bytes"]) is not None else None
    row["total_gib"] = pick("total_gib", last.get("comm_gib", total_gib))
    row["wall_seconds"] = pick("wall_seconds", last.get("wall_seconds"))
    row["stopped_by"] = s.get("stopped_by")
    row["target_accuracy"] = target
    row["rounds_to_target"], row["gib_to_target"] = to_target(run.metrics, target)
    for kind, nbytes in sorted((s.get("comm_bytes_by_kind") or last.get("comm_bytes_by_kind") or {}).items()):
        row[f"bytes_{kind}"] = nbytes
    return row


def _hashable(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return json.dumps(value, sort_keys=True, default=str)


def _experiment_key(config: dict) -> str:
    """Runs with the same key differ only in seed (and output directory, device, resume flags)."""
    return json.dumps({k: v for k, v in config.items() if k not in _NOT_EXPERIMENT},
                      sort_keys=True, default=str)


# --------------------------------------------------------------------------- analysis


class _Analysis:
    """Runs, their result rows, seed groups and the table layout of one sweep directory."""

    def __init__(self, sweep_dir: Path, target_accuracy: float | None):
        self.dir = sweep_dir
        self.runs, self.snapshot = _load(sweep_dir)
        self.axes: dict = self.snapshot.get("axes") or {}
        self.finished = [r for r in self.runs if r.status == "finished"]
        self.target, self.target_source = self._target(target_accuracy)

        varying = self._varying([r.config for r in self.runs if r.status != "pending"] or
                                [r.config for r in self.runs])
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
        bests = [_num(r.summary.get("best_accuracy")) for r in self.finished if r.summary]
        bests += [_num(m.get("test_accuracy")) for r in self.finished for m in r.metrics]
        bests = [b for b in bests if b is not None]
        if not bests or max(bests) <= 0:
            return None, "no finished runs"
        value = math.floor(DEFAULT_TARGET_FRACTION * max(bests) * 100 + 1e-9) / 100
        return max(value, 0.01), (f"default: {DEFAULT_TARGET_FRACTION:.0%} of the best accuracy any "
                                  f"run reached, rounded down to a whole percent; set it with --target")

    # ---- layout
    def _key_order(self, keys: Iterable[str]) -> list[str]:
        axis_order = [k for k in self.axes if k in keys]
        rest = [k for k in _PREFERRED_ORDER if k in keys and k not in axis_order]
        rest += sorted(k for k in keys if k not in axis_order and k not in rest)
        return axis_order + rest

    @staticmethod
    def _varying(configs: list[dict]) -> list[str]:
        keys = {k for c in configs for k in c} - set(_NOT_EXPERIMENT)
        return sorted(k for k in keys if len({_hashable(c.get(k)) for c in configs}) > 1)

    def values_in_order(self, key: str, values: Iterable[Any]) -> list[Any]:
        uniq: dict = {}
        for v in values:
            uniq.setdefault(_hashable(v), v)
        axis = [_hashable(v) for v in self.axes.get(key, [])]
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
            return tuple(_hashable(cfg.get(k)) for k in keys)

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
            ordered = [()]
            for i, k in enumerate(keys):
                vals = self.values_in_order(k, [c.get(k) for c in group_configs.values()])
                ordered = [t + (_hashable(v),) for t in ordered for v in vals]
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


# --------------------------------------------------------------------------- tables


def _decimals_for(values: list[float]) -> int:
    """3 to 4 significant digits for the largest magnitude among the values."""
    big = max((abs(v) for v in values), default=0.0)
    if big == 0:
        return 2
    return int(min(8, max(0, 3 - math.floor(math.log10(big)))))


def mean_std(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof = 1); std is None for a single value."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


@dataclass
class _Cell:
    text: str
    rank_value: float | None  # None: not ranked
    n: int


def _format_cell(values: list[float], decimals: int | None, scale: float, as_bytes: bool = False) -> tuple[str, float]:
    values = [v * scale for v in values]
    mean, std = mean_std(values)
    if as_bytes:  # adaptive units; ranked on the value as displayed, in bytes
        text = format_bytes(mean, std)
        return text, float(text.split()[0]) * byte_unit(mean)[1]
    d = decimals if decimals is not None else _decimals_for([mean])
    text = f"{mean:.{d}f}" + (f" ± {std:.{d}f}" if std is not None else "")
    return text, float(f"{mean:.{d}f}")


def _metric_table(an: _Analysis, column: str, header: str, *, scale: float = 1.0, decimals: int | None = 2,
                  higher_is_better: bool = True, partial_ok: bool = False, as_bytes: bool = False) -> str:
    """Markdown table of `column` from the result rows: rows x columns of the layout."""
    grid: dict[tuple, dict[tuple, _Cell]] = {}
    for row in an.row_tuples:
        for col in an.col_tuples:
            g = an.cells.get((row, col))
            if g is None:
                continue
            rows = an.group_rows(g)
            values = [_num(r.get(column)) for r in rows]
            got = [v for v in values if v is not None]
            if not got:
                grid.setdefault(row, {})[col] = _Cell("not reached" if partial_ok else "–", None, len(rows))
                continue
            text, rank = _format_cell(got, decimals, scale, as_bytes)
            if len(got) < len(values):
                text += f" ({len(got)}/{len(values)} reached)" if partial_ok else f" ({len(got)} of {len(values)})"
                rank = None  # not comparable with cells where every seed counts
            grid.setdefault(row, {})[col] = _Cell(text, rank, len(got))

    ns = Counter(c.n for cols in grid.values() for c in cols.values())
    common_n = ns.most_common(1)[0][0] if ns else 0
    marks: dict[tuple, dict[tuple, str]] = {}
    for col in an.col_tuples:
        ranked = sorted({c[col].rank_value for c in grid.values() if col in c and c[col].rank_value is not None},
                        reverse=higher_is_better)
        for row, cols in grid.items():
            cell = cols.get(col)
            if cell is None or cell.rank_value is None:
                continue
            if len(ranked) >= 2 and cell.rank_value == ranked[0]:
                marks.setdefault(row, {})[col] = "best"
            elif len(ranked) >= 3 and cell.rank_value == ranked[1]:
                marks.setdefault(row, {})[col] = "second"

    head = "method" if an.row_keys[:1] == ["algorithm"] else (" / ".join(an.row_keys) or "runs")
    col_names = [_md(an.col_label(c)) for c in an.col_tuples] if an.col_keys else [header]
    lines = ["| " + " | ".join([head] + col_names) + " |",
             "|" + "---|" + "---:|" * len(an.col_tuples)]
    for row in an.row_tuples:
        cells = []
        for col in an.col_tuples:
            cell = grid.get(row, {}).get(col)
            if cell is None:
                cells.append("")
                continue
            text = cell.text + (f" (n={cell.n})" if cell.n != common_n and cell.rank_value is not None else "")
            mark = marks.get(row, {}).get(col)
            cells.append(f"**{text}**" if mark == "best" else f"<u>{text}</u>" if mark == "second" else text)
        lines.append("| " + " | ".join([_md(an.row_label(row))] + cells) + " |")
    return "\n".join(lines)


def _md(text: str) -> str:
    return text.replace("|", "\\|")


# --------------------------------------------------------------------------- plots


def _figure(n_panels: int, width: float = 5.2, height: float = 3.8, max_cols: int = 3):
    """A figure with one panel per table column; the panels share the y-axis, so heights compare."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = max(1, min(max_cols, n_panels))
    nrows = max(1, math.ceil(n_panels / ncols))
    fig = Figure(figsize=(width * ncols, height * nrows))
    FigureCanvasAgg(fig)
    axes: list = []
    for i in range(max(1, n_panels)):
        axes.append(fig.add_subplot(nrows, ncols, i + 1, sharey=axes[0] if axes else None))
    return fig, axes


def _log_x(ax) -> None:
    """Log x-axis whose labels cannot collide: at most 5 labelled ticks (1, 2, 5 x 10^k, thinned
    by matplotlib), short labels, and unlabelled minor ticks (which matplotlib labels by default
    when the data span less than a decade, and which then overlap)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=5))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _over_seeds(an: _Analysis) -> str:
    """The title suffix: "mean ± std over seeds" only when some cell has several seeds."""
    n = max((len(idx) for idx in an.groups.values()), default=0)
    return " (mean ± std over seeds)" if n > 1 else (" (one seed per curve)" if n == 1 else "")


def _same_curve(a: tuple[list, list], b: tuple[list, list]) -> bool:
    return len(a[0]) == len(b[0]) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12)
                                          for u, v in zip(a, b) for x, y in zip(u, v))


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    return path


_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


class _Styler:
    """Colour by the first row key (algorithm), line style and marker by the rest."""

    def __init__(self, an: _Analysis):
        self.an = an
        heads = []
        for r in an.row_tuples:
            if r[:1] not in heads:
                heads.append(r[:1])
        self.color = {h: f"C{i % 10}" for i, h in enumerate(heads)}

    def __call__(self, row: tuple) -> dict:
        same = [r for r in self.an.row_tuples if r[:1] == row[:1]]
        i = same.index(row) if row in same else 0
        return {"color": self.color.get(row[:1], "C0"), "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
                "marker": _MARKERS[i % len(_MARKERS)]}


def _curve(runs: list[RunData], x_of: Callable[[dict], float | None]) -> tuple[list, list, list]:
    """Mean over seeds per round: (x, mean accuracy %, std %)."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for m in run.metrics:
            acc, x = _num(m.get("test_accuracy")), x_of(m)
            if acc is not None and x is not None:
                by_round.setdefault(int(m["round"]), []).append((x, 100 * acc))
    xs, ys, ss = [], [], []
    for r in sorted(by_round):
        pts = by_round[r]
        xs.append(statistics.fmean(p[0] for p in pts))
        mean, std = mean_std([p[1] for p in pts])
        ys.append(mean)
        ss.append(std or 0.0)
    return xs, ys, ss


def _legend(fig, axes) -> None:
    handles, labels = {}, []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in handles:
                handles[lab] = h
                labels.append(lab)
    if labels:
        fig.legend([handles[lab] for lab in labels], labels, loc="center left",
                   bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)


def _plot_curves(an: _Analysis, path: Path, x_of: Callable[[dict], float | None], xlabel: str,
                 title: str, logx: bool = False) -> Path:
    return _save(_curves_figure(an, x_of, xlabel, title, logx), path)


def _curves_figure(an: _Analysis, x_of: Callable[[dict], float | None], xlabel: str, title: str,
                   logx: bool = False):
    """One panel per table column, one curve per row; a curve equal to one drawn before it in the
    same panel (SFL-V1 under FedAvg vs rounds) is labelled "= <that one>" and drawn dashed on top."""
    fig, axes = _figure(len(an.col_tuples))
    style = _Styler(an)
    for ax, col in zip(axes, an.col_tuples):
        drawn: list[tuple[str, tuple[list, list]]] = []
        for row in an.row_tuples:
            g = an.cells.get((row, col))
            if g is None:
                continue
            xs, ys, ss = _curve(an.group_runs(g), x_of)
            if logx:
                keep = [i for i, x in enumerate(xs) if x > 0]
                xs, ys, ss = [xs[i] for i in keep], [ys[i] for i in keep], [ss[i] for i in keep]
            if not xs:
                continue
            st = style(row)
            label = an.row_label(row)
            twin = next((name for name, curve in drawn if _same_curve(curve, (xs, ys))), None)
            if twin is not None:
                ax.plot(xs, ys, label=f"{label} (= {twin}, identical)", color=st["color"], linestyle=(0, (2, 2)),
                        marker=st["marker"], markersize=5, markerfacecolor="none", linewidth=2.2, zorder=3)
            else:
                ax.plot(xs, ys, label=label, color=st["color"], linestyle=st["linestyle"],
                        marker=st["marker"], markersize=3, linewidth=1.4)
            if any(ss):
                ax.fill_between(xs, [y - s for y, s in zip(ys, ss)], [y + s for y, s in zip(ys, ss)],
                                color=st["color"], alpha=0.15, linewidth=0)
            drawn.append((label, (xs, ys)))
        if logx and drawn:
            _log_x(ax)
        if not drawn:
            ax.text(0.5, 0.5, "no data" + (" (no communication recorded)" if logx else ""),
                    ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        if an.col_keys:
            ax.set_title(an.col_label(col), fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
    fig.suptitle(title + _over_seeds(an), fontsize=11)
    _legend(fig, axes)
    return fig


def _plot_vs_cut(an: _Analysis, path: Path) -> Path:
    fig, axes = _figure(len(an.col_tuples))
    style = _Styler(an)
    cut_i = an.row_keys.index("cut") if "cut" in an.row_keys else None
    for ax, col in zip(axes, an.col_tuples):
        lines: dict[tuple, list[tuple[Any, float, float, tuple]]] = {}
        for row in an.row_tuples:
            g = an.cells.get((row, col))
            if g is None:
                continue
            accs = [_num(r.get("final_accuracy")) for r in an.group_rows(g)]
            accs = [100 * a for a in accs if a is not None]
            if not accs:
                continue
            cut = an.group_runs(g)[0].config.get("cut")
            mean, std = mean_std(accs)
            key = row[:cut_i] + row[cut_i + 1:] if cut_i is not None else row
            lines.setdefault(key, []).append((cut, mean, std or 0.0, row))
        all_cuts = sorted({p[0] for pts in lines.values() for p in pts if _num(p[0]) is not None})
        for key, pts in lines.items():
            st = style(pts[0][3])
            label = an.row_label(pts[0][3]) if cut_i is None else _line_label(an, key, cut_i)
            numeric = [p for p in pts if _num(p[0]) is not None]
            if len(numeric) >= 2 or (numeric and len(all_cuts) <= 1):
                numeric.sort(key=lambda p: p[0])
                ax.errorbar([p[0] for p in numeric], [p[1] for p in numeric], yerr=[p[2] for p in numeric],
                            label=label, color=st["color"], linestyle=st["linestyle"], marker=st["marker"],
                            capsize=3, linewidth=1.4, markersize=4)
            else:  # one point (e.g. FedAvg, which has no cut): a horizontal reference line
                _, mean, std, _ = pts[0]
                ax.axhline(mean, color=st["color"], linestyle="--", linewidth=1.2, label=f"{label} (no cut)")
                if std:
                    ax.axhspan(mean - std, mean + std, color=st["color"], alpha=0.1, linewidth=0)
        if all_cuts:
            ax.set_xticks(all_cuts)
        else:
            ax.text(0.5, 0.5, "no finished runs", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("cut layer")
        ax.set_ylabel("final test accuracy (%)")
        if an.col_keys:
            ax.set_title(an.col_label(col), fontsize=10)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Final test accuracy vs cut layer" + _over_seeds(an), fontsize=11)
    _legend(fig, axes)
    return _save(fig, path)


def _line_label(an: _Analysis, key: tuple, cut_i: int) -> str:
    keys = an.row_keys[:cut_i] + an.row_keys[cut_i + 1:]
    if not keys:
        return "all"
    head = str(key[0]) if keys[0] == "algorithm" else f"{keys[0]}={key[0]}"
    rest = [f"{k}={v}" for k, v in zip(keys[1:], key[1:])]
    return head + (f" ({', '.join(rest)})" if rest else "")


def _partitions(an: _Analysis) -> list[tuple[str, RunData]]:
    """One run per distinct (dataset, partition, clients), preferring the smallest seed."""
    chosen: dict[tuple, RunData] = {}
    def seed_order(run: RunData) -> tuple:
        seed = run.config.get("seed")
        return (0, seed, run.name) if isinstance(seed, int) else (1, 0, run.name)

    for run in sorted((r for r in an.runs if r.partition), key=seed_order):
        cfg = run.config
        key = (_hashable(cfg.get("dataset")), _hashable(cfg.get("partition")), _hashable(cfg.get("clients")),
               _hashable(cfg.get("train_subset")))
        chosen.setdefault(key, run)
    def panel_order(run: RunData) -> tuple:
        return tuple(_position(an, k, run.config.get(k)) for k in ("dataset", "partition", "clients"))

    out = []
    for run in sorted(chosen.values(), key=panel_order):
        cfg = run.config
        bits = [str(cfg[k]) for k in ("dataset", "partition") if cfg.get(k) is not None]
        if cfg.get("seed") is not None:
            bits.append(f"seed {cfg['seed']}")
        out.append((", ".join(bits) or run.name, run))
    return out


def _position(an: _Analysis, key: str, value: Any) -> int:
    values = [_hashable(v) for v in an.values_in_order(key, [r.config.get(key) for r in an.runs])]
    return values.index(_hashable(value)) if _hashable(value) in values else len(values)


def _plot_partitions(an: _Analysis, path: Path) -> Path | None:
    parts = _partitions(an)
    if not parts:
        return None
    import numpy as np

    fig, axes = _figure(len(parts), width=6.0, height=3.6, max_cols=2)
    for ax, (title, run) in zip(axes, parts):
        counts = np.asarray(run.partition.get("counts") or [[0]], dtype=float)
        k, c = counts.shape
        if c <= 10:
            colors = [f"C{i}" for i in range(c)]
        else:
            from matplotlib import colormaps

            cmap = colormaps["tab20" if c <= 20 else "viridis"]
            colors = [cmap(i / max(1, c - 1)) if c > 20 else cmap(i) for i in range(c)]
        bottom = np.zeros(k)
        x = np.arange(k)
        for j in range(c):
            ax.bar(x, counts[:, j], bottom=bottom, color=colors[j], width=0.85 if k < 60 else 1.0,
                   label=f"class {j}" if c <= 20 else None, linewidth=0)
            bottom += counts[:, j]
        ax.set_xlabel("client")
        ax.set_ylabel("training samples")
        ax.set_title(title, fontsize=10)
        if k <= 20:
            ax.set_xticks(x)
        ax.set_xlim(-0.6, k - 0.4)
    fig.suptitle("Label distribution per client", fontsize=11)
    _legend(fig, axes[:1])
    return _save(fig, path)


# --------------------------------------------------------------------------- writing


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return value


def _write_csv(an: _Analysis, path: Path) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=an.columns, lineterminator="\n")
    writer.writeheader()
    for row in an.rows:
        writer.writerow({k: _csv_value(row.get(k)) for k in an.columns})
    write_text(path, buf.getvalue())


def collect_results(sweep_dir: str | os.PathLike, target_accuracy: float | None = None) -> list[dict]:
    """One dict per run (finished, incomplete, failed or not started) with the columns of
    results.csv; numbers as in the engine's files (accuracies are fractions)."""
    an = _Analysis(_check_dir(sweep_dir), target_accuracy)
    return [{k: row.get(k) for k in an.columns} for row in an.rows]


def _check_dir(sweep_dir: str | os.PathLike) -> Path:
    path = Path(sweep_dir)
    if not path.is_dir():
        raise UserError(f"sweep directory {path} not found")
    return path


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def write_report(sweep_dir: str | os.PathLike, target_accuracy: float | None = None,
                 warn: Callable[[str], None] = _warn_stderr) -> Path:
    """Write results.csv, report.md and plots/*.png into `sweep_dir`; return report.md's path.

    `target_accuracy` (a fraction, e.g. 0.8) is the accuracy for the "GiB / rounds to target"
    tables; by default it comes from the sweep file's `report.target_accuracy`, else it is 80%
    of the best accuracy any run reached, rounded down to a whole percent. Each run whose
    summary.json or metrics.jsonl is unreadable (truncated, garbage, non-finite numbers) is
    reported through `warn` and left out of every table and plot.
    """
    path = _check_dir(sweep_dir)
    an = _Analysis(path, target_accuracy)
    for run in an.runs:
        if run.status == "unreadable":
            warn(f"{run.path}: {run.error}; left out of the tables and plots")
    if not an.runs:
        raise UserError(f"{path} holds no runs (subdirectories with config.yaml or summary.json, "
                        f"or a {SNAPSHOT} from `splitlab sweep`)")
    _write_csv(an, path / RESULTS)

    plots: list[tuple[str, Path]] = []
    if an.finished:
        plot_dir = path / PLOTS
        plots.append(("Test accuracy vs round", _plot_curves(
            an, plot_dir / "accuracy_vs_round.png", lambda m: _num(m.get("round")), "round",
            "Test accuracy vs round")))
        plots.append(("Test accuracy vs communication", _plot_curves(
            an, plot_dir / "accuracy_vs_gib.png", row_gib, "communication (GiB, cumulative, log scale)",
            "Test accuracy vs GiB communicated", logx=True)))
        if any("cut" in r.config for r in an.finished):
            plots.append(("Final test accuracy vs cut layer", _plot_vs_cut(an, plot_dir / "accuracy_vs_cut.png")))
        part = _plot_partitions(an, plot_dir / "label_distribution.png")
        if part is not None:
            plots.append(("Label distribution per client", part))

    write_text(path / REPORT, _markdown(an, path, plots))
    return path / REPORT


def _markdown(an: _Analysis, path: Path, plots: list[tuple[str, Path]]) -> str:
    counts = Counter(r.status for r in an.runs)
    title = Path(str(an.snapshot.get("source") or path.name)).stem
    out = [f"# Sweep report: {title}", ""]
    if an.snapshot.get("description"):
        out += [str(an.snapshot["description"]).strip(), ""]
    status = ", ".join(f"{counts[s]} {s if s != 'pending' else 'not started'}"
                       for s in ("finished", "incomplete", "failed", "unreadable", "pending") if counts[s])
    out += [f"{len(an.runs)} runs in `{path}`: {status}. One row per run in [`{RESULTS}`]({RESULTS}).", ""]
    if not an.finished:
        out += ["No run has finished yet; tables and plots appear once runs finish.", ""]
        out += _unfinished(an)
        return "\n".join(out) + "\n"

    seeds = Counter(len(idx) for idx in an.groups.values())
    common_n = seeds.most_common(1)[0][0]
    n_text = (f"n = {common_n} seed{'s' if common_n != 1 else ''} per cell" +
              (" unless marked (n=...)" if len(seeds) > 1 else ""))
    fixed = []
    common_cfg = an.finished[0].config
    for key in _FIXED_SHOWN:
        vals = {_hashable(r.config.get(key)) for r in an.finished}
        if key in common_cfg and len(vals) == 1 and common_cfg[key] is not None:
            fixed.append(f"{key}={common_cfg[key]}")
    out += [
        "Each cell aggregates the finished runs whose configs differ only in `seed`: "
        "**mean ± sample standard deviation** (ddof = 1, i.e. divided by n − 1) over those seeds; "
        f"{n_text}; a cell with a single seed shows its value without ±. "
        "In each column the best value is **bold** and the second best <u>underlined</u> "
        "(as in the papers; marks appear when a column has at least 2, resp. 3, different values; "
        "ranking uses the values as displayed).",
        "",
    ]
    if fixed:
        out += ["Common settings: " + ", ".join(f"`{f}`" for f in fixed) + ".", ""]

    out += ["## Final test accuracy (%)", "", "Test accuracy after the last round.", "",
            _metric_table(an, "final_accuracy", "final accuracy (%)", scale=100.0), ""]
    out += ["## Best test accuracy (%)", "", "Highest test accuracy over the evaluated rounds.", "",
            _metric_table(an, "best_accuracy", "best accuracy (%)", scale=100.0), ""]
    if an.target is not None:
        t = f"{100 * an.target:.4g}%"
        out += [f"## Communication to reach {t} test accuracy", "",
                f"Target {t} ({an.target_source}). Cumulative bytes (all message kinds; KiB/MiB/GiB are 2^10/2^20/2^30) at the "
                f"first evaluated round whose test accuracy is >= the target; lower is better. "
                f"\"k/n reached\": only k of the n seeds got there (mean over those; not ranked).", "",
                _metric_table(an, "gib_to_target", "communication to target", scale=GIB, higher_is_better=False,
                              partial_ok=True, as_bytes=True), ""]
        out += [f"## Rounds to reach {t} test accuracy", "",
                "First evaluated round whose test accuracy is >= the target; lower is better.", "",
                _metric_table(an, "rounds_to_target", "rounds to target", decimals=1, higher_is_better=False, partial_ok=True), ""]
    out += ["## Total communication", "", "Cumulative bytes communicated over the whole run.", "",
            _metric_table(an, "total_gib", "total communication", scale=GIB, higher_is_better=False, as_bytes=True), ""]
    if plots:
        out += ["## Plots", ""]
        for caption, p in plots:
            rel = p.relative_to(path).as_posix()
            out += [f"### {caption}", "", f"![{caption}]({rel})", ""]
    out += _unfinished(an)
    return "\n".join(out).rstrip() + "\n"


def _unfinished(an: _Analysis) -> list[str]:
    rows = [r for r in an.runs if r.status != "finished"]
    if not rows:
        return []
    out = ["## Runs not finished", "", "| run | status | rounds done | note |", "|---|---|---:|---|"]
    for run in rows:
        done = int(run.metrics[-1]["round"]) if run.metrics else 0
        note = ""
        if run.error:
            lines = [ln for ln in run.error.strip().splitlines() if ln.strip()]
            note = lines[-1].strip() if lines else "failed"
        elif run.status == "incomplete":
            note = "resumes from its checkpoint" if (run.path / "checkpoint.pt").exists() else "in progress or interrupted"
        out.append(f"| {_md(run.name)} | {run.status if run.status != 'pending' else 'not started'} | {done} | "
                   f"{_md(note)} |")
    return out + [""]
