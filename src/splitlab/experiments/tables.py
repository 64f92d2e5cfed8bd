"""report.md: the markdown tables (mean ± sample std over seeds, best bold, second underlined).

A cell with one seed shows the value alone. Accuracies are shown in percent and communication in
adaptive binary units (`splitlab.units.format_bytes`); `results.csv` keeps the engine's numbers.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from splitlab.experiments.analysis import Analysis, hashable
from splitlab.experiments.runs import num
from splitlab.rundir import CHECKPOINT
from splitlab.units import GIB, byte_unit, format_bytes

REPORT = "report.md"


RESULTS = "results.csv"


PLOTS = "plots"


_FIXED_SHOWN = (
    "dataset",
    "model",
    "partition",
    "clients",
    "rounds",
    "local_epochs",
    "batch_size",
    "optimizer",
    "lr",
    "train_subset",
)


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


def _metric_table(
    an: Analysis,
    column: str,
    header: str,
    *,
    scale: float = 1.0,
    decimals: int | None = 2,
    higher_is_better: bool = True,
    partial_ok: bool = False,
    as_bytes: bool = False,
) -> str:
    """Markdown table of `column` from the result rows: rows x columns of the layout."""
    grid: dict[tuple, dict[tuple, _Cell]] = {}
    for row in an.row_tuples:
        for col in an.col_tuples:
            g = an.cells.get((row, col))
            if g is None:
                continue
            rows = an.group_rows(g)
            values = [num(r.get(column)) for r in rows]
            got = [v for v in values if v is not None]
            if not got:
                grid.setdefault(row, {})[col] = _Cell("not reached" if partial_ok else "–", None, len(rows))
                continue
            text, rank = _format_cell(got, decimals, scale, as_bytes)
            complete = len(got) == len(values)
            if not complete:
                text += f" ({len(got)}/{len(values)} reached)" if partial_ok else f" ({len(got)} of {len(values)})"
            # a cell where some seeds did not count is not ranked: not comparable with complete cells
            grid.setdefault(row, {})[col] = _Cell(text, rank if complete else None, len(got))

    ns = Counter(c.n for cols in grid.values() for c in cols.values())
    common_n = ns.most_common(1)[0][0] if ns else 0
    marks: dict[tuple, dict[tuple, str]] = {}
    for col in an.col_tuples:
        ranks = [c[col].rank_value for c in grid.values() if col in c]
        ranked = sorted({r for r in ranks if r is not None}, reverse=higher_is_better)
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
    lines = ["| " + " | ".join([head] + col_names) + " |", "|" + "---|" + "---:|" * len(an.col_tuples)]
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


def markdown(an: Analysis, path: Path, plots: list[tuple[str, Path]]) -> str:
    counts = Counter(r.status for r in an.runs)
    title = Path(str(an.snapshot.get("source") or path.name)).stem
    out = [f"# Sweep report: {title}", ""]
    if an.snapshot.get("description"):
        out += [str(an.snapshot["description"]).strip(), ""]
    status = ", ".join(
        f"{counts[s]} {s if s != 'pending' else 'not started'}"
        for s in ("finished", "incomplete", "failed", "unreadable", "pending")
        if counts[s]
    )
    out += [f"{len(an.runs)} runs in `{path}`: {status}. One row per run in [`{RESULTS}`]({RESULTS}).", ""]
    if not an.finished:
        out += ["No run has finished yet; tables and plots appear once runs finish.", ""]
        out += _unfinished(an)
        return "\n".join(out) + "\n"

    seeds = Counter(len(idx) for idx in an.groups.values())
    common_n = seeds.most_common(1)[0][0]
    n_text = f"n = {common_n} seed{'s' if common_n != 1 else ''} per cell" + (
        " unless marked (n=...)" if len(seeds) > 1 else ""
    )
    fixed = []
    common_cfg = an.finished[0].config
    for key in _FIXED_SHOWN:
        vals = {hashable(r.config.get(key)) for r in an.finished}
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

    out += _section(
        "Final test accuracy (%)",
        "Test accuracy after the last round.",
        _metric_table(an, "final_accuracy", "final accuracy (%)", scale=100.0),
    )
    out += _section(
        "Best test accuracy (%)",
        "Highest test accuracy over the evaluated rounds.",
        _metric_table(an, "best_accuracy", "best accuracy (%)", scale=100.0),
    )
    if an.target is not None:
        t = f"{100 * an.target:.4g}%"
        out += _section(
            f"Communication to reach {t} test accuracy",
            f"Target {t} ({an.target_source}). Cumulative bytes (all message kinds; KiB/MiB/GiB are "
            f"2^10/2^20/2^30) at the "
            f"first evaluated round whose test accuracy is >= the target; lower is better. "
            f'"k/n reached": only k of the n seeds got there (mean over those; not ranked).',
            _metric_table(
                an,
                "gib_to_target",
                "communication to target",
                scale=GIB,
                higher_is_better=False,
                partial_ok=True,
                as_bytes=True,
            ),
        )
        out += _section(
            f"Rounds to reach {t} test accuracy",
            "First evaluated round whose test accuracy is >= the target; lower is better.",
            _metric_table(
                an, "rounds_to_target", "rounds to target", decimals=1, higher_is_better=False, partial_ok=True
            ),
        )
    if any(r.get("bleu") is not None for r in an.rows):
        out += _section(
            "Generation: BLEU and ROUGE-L",
            "The final model's greedy continuations of the test prompts (`eval_generate`), scored against "
            "all references of each: corpus BLEU (sacrebleu, 0-100) and the mean ROUGE-L F-measure "
            "(rouge-score, 0-1).",
            _metric_table(an, "bleu", "BLEU"),
            _metric_table(an, "rouge_l", "ROUGE-L", decimals=3),
        )
    out += _section(
        "Total communication",
        "Cumulative bytes communicated over the whole run.",
        _metric_table(an, "total_gib", "total communication", scale=GIB, higher_is_better=False, as_bytes=True),
    )
    if plots:
        out += ["## Plots", ""]
        for caption, p in plots:
            rel = p.relative_to(path).as_posix()
            out += [f"### {caption}", "", f"![{caption}]({rel})", ""]
    out += _at_chance(an)
    out += _unfinished(an)
    return "\n".join(out).rstrip() + "\n"


def _section(title: str, text: str, *tables: str) -> list[str]:
    """A section of results.md: its heading, what it shows, then its tables."""
    return [f"## {title}", "", text, "", *(line for table in tables for line in (table, ""))]


CHANCE_MARGIN = 1.2
"""A finished run whose final accuracy is at most this times chance (1 / classes) did not learn."""


def _at_chance(an: Analysis) -> list[str]:
    """The finished runs stuck at chance level: they enter the means above, and a reader must know."""
    rows = []
    for run in an.finished:
        classes = (run.partition or {}).get("num_classes")
        final = num((run.summary or {}).get("final_accuracy"))
        if isinstance(classes, int) and classes > 1 and final is not None and final <= CHANCE_MARGIN / classes:
            rows.append(f"| {_md(run.name)} | {100 * final:.2f} | {100 / classes:.2f} |")
    if not rows:
        return []
    return [
        "## Runs at chance level",
        "",
        f"These finished runs ended at most {CHANCE_MARGIN:g}x chance (1 / classes): they did not learn "
        "(learning rate? partition?), yet they are in the means above.",
        "",
        "| run | final accuracy (%) | chance (%) |",
        "|---|---:|---:|",
        *rows,
        "",
    ]


def _unfinished(an: Analysis) -> list[str]:
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
            note = "resumes from its checkpoint" if (run.path / CHECKPOINT).exists() else "in progress or interrupted"
        out.append(
            f"| {_md(run.name)} | {run.status if run.status != 'pending' else 'not started'} | {done} | {_md(note)} |"
        )
    return out + [""]
