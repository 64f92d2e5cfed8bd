"""plots/*.png: accuracy vs round and vs communication, accuracy vs cut, label distribution;
for language runs also test loss and perplexity vs round and vs communication (FSL-SAGE's Fig. 5).

One panel per table column, sharing the y-axis; matplotlib's Agg canvas (no display needed).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from splitlab.experiments.analysis import Analysis, hashable
from splitlab.experiments.runs import RunData, num
from splitlab.experiments.tables import mean_std
from splitlab.units import row_gib


class Metric(NamedTuple):
    """A per-round metric a curve plots: its key in metrics.jsonl, a factor, the axis label."""

    key: str
    scale: float
    label: str
    log: bool = False  # a log y-axis (perplexity spans orders of magnitude early in training)


ACCURACY = Metric("test_accuracy", 100.0, "test accuracy (%)")
LOSS = Metric("test_loss", 1.0, "test loss (masked cross-entropy)")
PERPLEXITY = Metric("test_perplexity", 1.0, "test perplexity (log scale)", log=True)


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


def _over_seeds(an: Analysis) -> str:
    """The title suffix: "mean ± std over seeds" only when some cell has several seeds."""
    n = max((len(idx) for idx in an.groups.values()), default=0)
    return " (mean ± std over seeds)" if n > 1 else (" (one seed per curve)" if n == 1 else "")


def _same_curve(a: tuple[list, list], b: tuple[list, list]) -> bool:
    return len(a[0]) == len(b[0]) and all(
        math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for u, v in zip(a, b) for x, y in zip(u, v)
    )


def save_png(fig, path: Path) -> Path:
    """Write a figure to `path` whole (through a temporary file beside it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}.png")
    fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")
    os.replace(tmp, path)
    return path


_LINESTYLES = ("-", "--", ":", "-.")


_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


class _Styler:
    """Colour by the first row key (algorithm), line style and marker by the rest."""

    def __init__(self, an: Analysis):
        self.an = an
        heads = []
        for r in an.row_tuples:
            if r[:1] not in heads:
                heads.append(r[:1])
        self.color = {h: f"C{i % 10}" for i, h in enumerate(heads)}

    def __call__(self, row: tuple) -> dict:
        same = [r for r in self.an.row_tuples if r[:1] == row[:1]]
        i = same.index(row) if row in same else 0
        return {
            "color": self.color.get(row[:1], "C0"),
            "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
            "marker": _MARKERS[i % len(_MARKERS)],
        }


def _curve(
    runs: list[RunData], x_of: Callable[[dict], float | None], metric: Metric = ACCURACY
) -> tuple[list, list, list]:
    """Mean over seeds per round: (x, mean of the metric, std), accuracy in %."""
    by_round: dict[int, list[tuple[float, float]]] = {}
    for run in runs:
        for m in run.metrics:
            value, x = num(m.get(metric.key)), x_of(m)
            if value is not None and x is not None:
                by_round.setdefault(int(m["round"]), []).append((x, metric.scale * value))
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
        fig.legend(
            [handles[lab] for lab in labels],
            labels,
            loc="center left",
            bbox_to_anchor=(1.0, 0.5),
            fontsize=8,
            frameon=False,
        )


def curves_figure(
    an: Analysis,
    x_of: Callable[[dict], float | None],
    xlabel: str,
    title: str,
    logx: bool = False,
    integer_x: bool = False,
    metric: Metric = ACCURACY,
):
    """One panel per table column, one curve per row of `metric`; a curve equal to one drawn before it in the
    same panel (SFL-V1 under FedAvg vs rounds) is labelled "= <that one>" and drawn dashed on top.
    `integer_x`: ticks at whole numbers only (rounds)."""
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(len(an.col_tuples))
    style = _Styler(an)
    for ax, col in zip(axes, an.col_tuples):
        drawn: list[tuple[str, tuple[list, list]]] = []
        for row in an.row_tuples:
            g = an.cells.get((row, col))
            if g is None:
                continue
            xs, ys, ss = _curve(an.group_runs(g), x_of, metric)
            if logx:
                keep = [i for i, x in enumerate(xs) if x > 0]
                xs, ys, ss = [xs[i] for i in keep], [ys[i] for i in keep], [ss[i] for i in keep]
            if not xs:
                continue
            st = style(row)
            label = an.row_label(row)
            twin = next((name for name, curve in drawn if _same_curve(curve, (xs, ys))), None)
            if twin is not None:
                ax.plot(
                    xs,
                    ys,
                    label=f"{label} (= {twin}, identical)",
                    **{**st, "linestyle": (0, (2, 2))},
                    markersize=5,
                    markerfacecolor="none",
                    linewidth=2.2,
                    zorder=3,
                )
            else:
                ax.plot(xs, ys, label=label, **st, markersize=3, linewidth=1.4)
            if any(ss):
                ax.fill_between(
                    xs,
                    [y - s for y, s in zip(ys, ss)],
                    [y + s for y, s in zip(ys, ss)],
                    color=st["color"],
                    alpha=0.15,
                    linewidth=0,
                )
            drawn.append((label, (xs, ys)))
        if logx and drawn:
            _log_x(ax)
        if not drawn:
            ax.text(
                0.5,
                0.5,
                "no data" + (" (no communication recorded)" if logx else ""),
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        ax.set_xlabel(xlabel)
        if integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(metric.label)
        if metric.log and drawn:
            ax.set_yscale("log")
        if an.col_keys:
            ax.set_title(an.col_label(col), fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
    fig.suptitle(title + _over_seeds(an), fontsize=11)
    _legend(fig, axes)
    return fig


def plot_run(rows: list[dict], path: Path, title: str) -> Path:
    """One run's curves from its metrics rows: test accuracy vs round (whole-number ticks) and vs
    GiB communicated (log scale), side by side with one y-axis."""
    from matplotlib.ticker import MaxNLocator

    fig, (by_round, by_gib) = _figure(2)
    accuracy = [100 * float(row["test_accuracy"]) for row in rows]
    by_round.plot([row["round"] for row in rows], accuracy, marker="o", markersize=3, linewidth=1.4)
    by_round.xaxis.set_major_locator(MaxNLocator(integer=True))
    by_round.set_xlabel("round")
    by_round.set_ylabel("test accuracy (%)")
    sent = [(gib, acc) for gib, acc in zip(map(row_gib, rows), accuracy) if gib is not None and gib > 0]
    if sent:
        by_gib.plot(*zip(*sent), marker="o", markersize=3, linewidth=1.4)
        _log_x(by_gib)
    else:
        by_gib.text(0.5, 0.5, "no communication recorded", ha="center", va="center", transform=by_gib.transAxes)
    by_gib.set_xlabel("communication (GiB, cumulative, log scale)")
    for ax in (by_round, by_gib):
        ax.grid(True, alpha=0.3, which="both")
    fig.suptitle(title, fontsize=11)
    return save_png(fig, path)


def plot_per_cut(
    path: Path, title: str, cuts: list[str], relative: dict[str, list[float]], absolute: dict[str, list[float]]
) -> Path:
    """`splitlab advise`'s picture: one line per quantity over the candidate cuts, `relative` ones
    (costs) divided by their largest value (dashed), `absolute` ones (shares, scores in [0, 1]) as they are."""
    fig, (ax,) = _figure(1, width=6, height=3.5)
    for label, values in relative.items():
        top = max(values) or 1
        ax.plot(cuts, [v / top for v in values], "--o", label=label)
    for label, values in absolute.items():
        ax.plot(cuts, values, "-s", label=label)
    ax.set(xlabel="cut", ylim=(0, 1.05), title=title)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    return save_png(fig, path)


def plot_vs_cut(an: Analysis, path: Path) -> Path:
    fig, axes = _figure(len(an.col_tuples))
    style = _Styler(an)
    cut_i = an.row_keys.index("cut") if "cut" in an.row_keys else None
    for ax, col in zip(axes, an.col_tuples):
        lines: dict[tuple, list[tuple[Any, float, float, tuple]]] = {}
        for row in an.row_tuples:
            g = an.cells.get((row, col))
            if g is None:
                continue
            finals = [num(r.get("final_accuracy")) for r in an.group_rows(g)]
            accs = [100 * a for a in finals if a is not None]
            if not accs:
                continue
            cut = an.group_runs(g)[0].config.get("cut")
            mean, std = mean_std(accs)
            key = row[:cut_i] + row[cut_i + 1 :] if cut_i is not None else row
            lines.setdefault(key, []).append((cut, mean, std or 0.0, row))
        all_cuts = sorted({p[0] for pts in lines.values() for p in pts if num(p[0]) is not None})
        for key, pts in lines.items():
            st = style(pts[0][3])
            label = an.row_label(pts[0][3]) if cut_i is None else _line_label(an, key, cut_i)
            numeric = [p for p in pts if num(p[0]) is not None]
            if len(numeric) >= 2 or (numeric and len(all_cuts) <= 1):
                numeric.sort(key=lambda p: p[0])
                ax.errorbar(
                    [p[0] for p in numeric],
                    [p[1] for p in numeric],
                    yerr=[p[2] for p in numeric],
                    label=label,
                    **st,
                    capsize=3,
                    linewidth=1.4,
                    markersize=4,
                )
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
    return save_png(fig, path)


def _line_label(an: Analysis, key: tuple, cut_i: int) -> str:
    keys = an.row_keys[:cut_i] + an.row_keys[cut_i + 1 :]
    if not keys:
        return "all"
    head = str(key[0]) if keys[0] == "algorithm" else f"{keys[0]}={key[0]}"
    rest = [f"{k}={v}" for k, v in zip(keys[1:], key[1:])]
    return head + (f" ({', '.join(rest)})" if rest else "")


def _partitions(an: Analysis) -> list[tuple[str, RunData]]:
    """One run per distinct (dataset, partition, clients), preferring the smallest seed."""
    chosen: dict[tuple, RunData] = {}

    def seed_order(run: RunData) -> tuple:
        seed = run.config.get("seed")
        return (0, seed, run.name) if isinstance(seed, int) else (1, 0, run.name)

    for run in sorted((r for r in an.runs if r.partition), key=seed_order):
        cfg = run.config
        key = (
            hashable(cfg.get("dataset")),
            hashable(cfg.get("partition")),
            hashable(cfg.get("clients")),
            hashable(cfg.get("train_subset")),
        )
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


def _position(an: Analysis, key: str, value: Any) -> int:
    values = [hashable(v) for v in an.values_in_order(key, [r.config.get(key) for r in an.runs])]
    return values.index(hashable(value)) if hashable(value) in values else len(values)


def plot_partitions(an: Analysis, path: Path) -> Path | None:
    parts = _partitions(an)
    if not parts:
        return None
    import numpy as np

    fig, axes = _figure(len(parts), width=6.0, height=3.6, max_cols=2)
    for ax, (title, run) in zip(axes, parts):
        partition = run.partition or {}  # never empty: _partitions keeps only runs with a partition
        counts = np.asarray(partition.get("counts") or [[0]], dtype=float)
        k, c = counts.shape
        colors: list[str | tuple[float, float, float, float]]
        if c <= 10:
            colors = [f"C{i}" for i in range(c)]
        else:
            from matplotlib import colormaps

            cmap = colormaps["tab20" if c <= 20 else "viridis"]
            colors = [cmap(i / max(1, c - 1)) if c > 20 else cmap(i) for i in range(c)]
        bottom = np.zeros(k)
        x = np.arange(k)
        for j in range(c):
            ax.bar(
                x,
                counts[:, j],
                bottom=bottom,
                color=colors[j],
                width=0.85 if k < 60 else 1.0,
                label=f"class {j}" if c <= 20 else None,
                linewidth=0,
            )
            bottom += counts[:, j]
        ax.set_xlabel("client")
        ax.set_ylabel("training samples")
        ax.set_title(title, fontsize=10)
        if k <= 20:
            ax.set_xticks(x)
        ax.set_xlim(-0.6, k - 0.4)
    fig.suptitle("Label distribution per client", fontsize=11)
    _legend(fig, axes[:1])
    return save_png(fig, path)
