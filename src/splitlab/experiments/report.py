"""Tables and plots from a sweep directory: `results.csv`, `report.md`, `plots/*.png`.

Works on whatever is in the directory: finished runs (with `summary.json`) make the tables and
plots; incomplete, failed, unreadable and not-yet-started runs are listed. Every table is
computed from the same rows that are written to `results.csv`, so the two always agree.

The work is split by concern: `runs` loads run directories, `analysis` makes the result rows and
the layout, `tables` writes report.md's tables, `plots` draws the PNGs; this module writes the
files.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from splitlab.errors import UserError
from splitlab.experiments.analysis import Analysis
from splitlab.experiments.plots import (
    ACCURACY,
    LOSS,
    PERPLEXITY,
    curves_figure,
    plot_partitions,
    plot_vs_cut,
    save_png,
)
from splitlab.experiments.runs import num
from splitlab.experiments.sweep import SNAPSHOT
from splitlab.experiments.tables import PLOTS, REPORT, RESULTS, markdown
from splitlab.io import write_text
from splitlab.units import row_gib

log = logging.getLogger(__name__)


#: The x axes of the curves in results.md: (file suffix, x of a metrics row, x label, caption's end, title's end).
CURVE_AXES = (
    ("round", lambda m: num(m.get("round")), "round", "round", "round"),
    ("gib", row_gib, "communication (GiB, cumulative, log scale)", "communication", "GiB communicated"),
)


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if isinstance(value, float):
        return repr(value)
    return value


def _write_csv(an: Analysis, path: Path) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=an.columns, lineterminator="\n")
    writer.writeheader()
    for row in an.rows:
        writer.writerow({k: _csv_value(row.get(k)) for k in an.columns})
    write_text(path, buf.getvalue())


def collect_results(sweep_dir: str | os.PathLike, target_accuracy: float | None = None) -> list[dict]:
    """One dict per run (finished, incomplete, failed or not started) with the columns of
    results.csv; numbers as in the engine's files (accuracies are fractions)."""
    an = Analysis(_check_dir(sweep_dir), target_accuracy)
    return [{k: row.get(k) for k in an.columns} for row in an.rows]


def _check_dir(sweep_dir: str | os.PathLike) -> Path:
    path = Path(sweep_dir)
    if not path.is_dir():
        raise UserError(f"sweep directory {path} not found")
    return path


def _warn_stderr(message: str) -> None:
    log.warning(f"warning: {message}")


def write_report(
    sweep_dir: str | os.PathLike, target_accuracy: float | None = None, warn: Callable[[str], None] = _warn_stderr
) -> Path:
    """Write results.csv, report.md and plots/*.png into `sweep_dir` (or a single run's directory);
    return report.md's path.

    `target_accuracy` (a fraction, e.g. 0.8) is the accuracy for the "GiB / rounds to target"
    tables; by default it comes from the sweep file's `report.target_accuracy`, else it is 80%
    of the best accuracy any run reached, rounded down to a whole percent. Each run whose
    summary.json or metrics.jsonl is unreadable (truncated, garbage, non-finite numbers) is
    reported through `warn` and left out of every table and plot.
    """
    path = _check_dir(sweep_dir)
    an = Analysis(path, target_accuracy)
    for run in an.runs:
        if run.status == "unreadable":
            warn(f"{run.path}: {run.error}; left out of the tables and plots")
    if not an.runs:
        raise UserError(
            f"{path} holds no runs (subdirectories with config.yaml or summary.json, "
            f"or a {SNAPSHOT} from `splitlab sweep`)"
        )
    _write_csv(an, path / RESULTS)

    plots: list[tuple[str, Path]] = []
    if an.finished:
        plot_dir = path / PLOTS
        metrics = [(ACCURACY, "accuracy")]
        if any(num(m.get(PERPLEXITY.key)) is not None for r in an.finished for m in r.metrics):  # language runs
            metrics += [(LOSS, "loss"), (PERPLEXITY, "perplexity")]
        for metric, name in metrics:
            for axis, x_of, xlabel, caption, title in CURVE_AXES:
                figure = curves_figure(
                    an, x_of, xlabel, f"Test {name} vs {title}", axis == "gib", axis == "round", metric
                )
                plots.append((f"Test {name} vs {caption}", save_png(figure, plot_dir / f"{name}_vs_{axis}.png")))
        if any("cut" in r.config for r in an.finished):
            plots.append(("Final test accuracy vs cut layer", plot_vs_cut(an, plot_dir / "accuracy_vs_cut.png")))
        part = plot_partitions(an, plot_dir / "label_distribution.png")
        if part is not None:
            plots.append(("Label distribution per client", part))

    write_text(path / REPORT, markdown(an, path, plots))
    return path / REPORT
