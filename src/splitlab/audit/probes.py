"""What both advisors do alike (splitlab.audit.advise for images and tables, advise_language for
language models): size the probes, find the Pareto front of the candidate cuts and pick one, and
write the table and the JSON. What they measure, and how they weigh it, stays in each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from splitlab.audit.records import attack_sizes
from splitlab.audit.settings import AdviseSettings
from splitlab.io import write_json, write_text

Row = dict[str, Any]


def probe_sizes(settings: AdviseSettings, train: int, test: int, defaults: tuple[int, int, int, int]) -> dict[str, int]:
    """The probes' train_subset and test_subset, and the attacker's targets and aux among the test
    samples: as given, else `defaults` (train, test, aux, targets) or what the split holds."""
    train_default, test_default, aux_default, targets_default = defaults
    sizes = {
        "train_subset": settings.train_subset or min(train_default, train),
        "test_subset": settings.test_subset or min(test_default, test),
    }
    targets, aux = attack_sizes(
        sizes["test_subset"], settings.aux, settings.targets, held_out=True, defaults=(aux_default, targets_default)
    )
    return {**sizes, "targets": targets, "aux": aux}


def pareto_front(rows: list[Row], trade_offs: Callable[[Row], tuple[float, ...]]) -> list[Any]:
    """The cuts of the rows no other row beats on all of its `trade_offs` (each: lower is better)."""

    def dominates(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
        return all(x <= y for x, y in zip(a, b)) and a != b

    return [row["cut"] for row in rows if not any(dominates(trade_offs(other), trade_offs(row)) for other in rows)]


#: a probe whose accuracy is within this of its floor (the most frequent class or target) is not ranked
FLOOR_MARGIN = 0.01


def front_and_pick(
    rows: list[Row],
    trade_offs: Callable[[Row], tuple[float, ...]],
    within: Callable[[Row], bool],
    preferred: Callable[[Row], tuple[float, ...]],
) -> dict[str, Any]:
    """The Pareto front and the pick: among the front's cuts `within` the budgets, the first by
    `preferred` (lowest first); None if no cut on the front is within them. A row whose probe is
    not trained enough to rank (`ranked` false: its accuracy at the floor, so its attacks measure
    an untrained model) is on neither: `unranked` lists them."""
    ranked = [row for row in rows if row.get("ranked", True)]
    front = pareto_front(ranked, trade_offs)
    best = min((row for row in ranked if row["cut"] in front and within(row)), key=preferred, default=None)
    unranked = [row["cut"] for row in rows if not row.get("ranked", True)]
    return {"pareto_front": front, "pick": None if best is None else best["cut"], "unranked": unranked}


def heading(settings: AdviseSettings, sizes: dict[str, int], sequences: bool = False) -> str:
    """The table's title and how the probes ran and were attacked (sizes in sequences for a language model)."""
    unit = "sequences" if sequences else "samples"
    return (
        f"# Cuts of {settings.model} on {settings.dataset}\n\n"
        f"Probe: {settings.algorithm}, {settings.rounds} rounds, {settings.clients} clients, "
        f"train_subset={sizes['train_subset']}, test_subset={sizes['test_subset']}{' sequences' * sequences}, "
        f"defense={settings.defense}, seed={settings.seed}. Attacker: aux={sizes['aux']} {unit}, "
        f"targets={sizes['targets']}, decoder epochs={settings.epochs}; "
    )


Column = tuple[str, str, str]  # a row's key, the column's title, the format of its cells


def table(columns: Sequence[Column], rows: list[Row], cell: Callable[[str, Any], str]) -> list[str]:
    """The markdown table of `rows`, one column per (key, title, format); `cell(format, value)`."""
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(fmt, row[key]) for key, _, fmt in columns) + " |" for row in rows]


def written(out: Path, result: dict[str, Any], markdown: str, *more: str) -> dict[str, Any]:
    """Write OUT/advise.md and advise.json (the `more` files are the caller's); what `advise` returns."""
    write_json(out / "advise.json", result)
    write_text(out / "advise.md", markdown)
    return {**result, "out": str(out), "markdown": markdown, "files": ["advise.md", "advise.json", *more]}
