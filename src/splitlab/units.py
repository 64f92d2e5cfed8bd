"""Communication facts shared by the engine's summary, the CLI and the sweep report.

One definition each: how a byte count is shown (adaptive binary units) and when a run first
reached a target accuracy (rounds and GiB to target). No torch import: the report uses it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

GIB = 2**30
_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40))


def byte_unit(nbytes: float) -> tuple[str, int]:
    """The largest binary unit in which `nbytes` is at least 1 (B for less than 1 KiB)."""
    name, size = _UNITS[0]
    for unit_name, unit_size in _UNITS:
        if abs(nbytes) >= unit_size:
            name, size = unit_name, unit_size
    return name, size


def format_bytes(nbytes: float, std: float | None = None) -> str:
    """`nbytes` in adaptive units with 3-4 significant digits ("512 B", "1.50 KiB", "384.6 MiB");
    with `std`, "mean ± std unit" in the unit of the mean."""
    name, size = byte_unit(nbytes)
    value = nbytes / size
    if size == 1:
        decimals = 0
    else:
        decimals = 0 if value == 0 else int(min(3, max(0, 3 - math.floor(math.log10(abs(value))))))
    text = f"{value:.{decimals}f}"
    if std is not None:
        text += f" ± {std / size:.{decimals}f}"
    return f"{text} {name}"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def row_gib(row: Mapping) -> float | None:
    """Cumulative GiB of a metrics row (`comm_gib`, or `comm_bytes` / 2^30 for older rows)."""
    gib = _number(row.get("comm_gib"))
    if gib is None and _number(row.get("comm_bytes")) is not None:
        gib = row["comm_bytes"] / GIB
    return gib


def to_target(rows: Iterable[Mapping], target: float | None) -> tuple[int | None, float | None]:
    """(round, cumulative GiB) of the first evaluated round whose test accuracy is >= `target`
    (None, None when it never was, or no target was set). Only evaluated rounds count."""
    if target is None:
        return None, None
    for row in rows:
        acc = _number(row.get("test_accuracy"))
        if acc is not None and acc >= target - 1e-12:
            return int(row["round"]), row_gib(row)
    return None, None
