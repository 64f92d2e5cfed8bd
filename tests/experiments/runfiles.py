"""Run directories fabricated with planted numbers, and readers for what `report` writes."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import yaml

from splitlab.rundir import CHECKPOINT

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- fabricated runs


def fabricate(
    sweep: Path,
    name: str,
    config: dict,
    accs: list[float],
    *,
    gib_per_round: float = 0.5,
    finished: bool = True,
    error: str | None = None,
    counts=None,
) -> Path:
    """A run directory as the engine writes it, with planted per-round accuracies."""
    run = sweep / name
    run.mkdir(parents=True)
    cfg = {
        "dataset": "digits",
        "model": "mlp",
        "clients": 2,
        "rounds": len(accs),
        "partition": "iid",
        "seed": 0,
        **config,
        "out": str(run),
    }
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for r, acc in enumerate(accs, 1):
        nbytes = int(round(gib_per_round * r * 2**30))
        rows.append(
            {
                "round": r,
                "test_accuracy": acc,
                "test_loss": 1 - acc,
                "test_f1": acc / 2,
                "test_mcc": acc / 3,
                "train_loss": 1.5 - acc,
                "comm_bytes": nbytes,
                "comm_gib": nbytes / 2**30,
                "comm_bytes_by_kind": {"smashed": nbytes // 2, "cut_grad": nbytes - nbytes // 2},
                "wall_seconds": float(r),
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = counts or [[3, 1, 0], [0, 2, 4]]
    (run / "partition.json").write_text(
        json.dumps(
            {
                "num_clients": len(counts),
                "num_classes": len(counts[0]),
                "counts": counts,
                "sizes": [sum(c) for c in counts],
            }
        )
    )
    if error is not None:
        (run / "error.txt").write_text(error)
    elif finished:
        best = max(range(len(accs)), key=lambda i: (accs[i], -i))
        last = rows[-1]
        summary = {
            **{k: cfg[k] for k in ("algorithm", "dataset", "model", "cut", "seed", "partition", "clients")},
            "rounds_completed": len(accs),
            "final_accuracy": accs[-1],
            "best_accuracy": accs[best],
            "best_round": best + 1,
            "final_loss": 1 - accs[-1],
            "final_f1": accs[-1] / 2,
            "final_mcc": accs[-1] / 3,
            "total_bytes": last["comm_bytes"],
            "total_gib": last["comm_gib"],
            "comm_bytes_by_kind": last["comm_bytes_by_kind"],
            "wall_seconds": float(len(accs)),
            "stopped_by": "rounds",
        }
        (run / "summary.json").write_text(json.dumps(summary))
    else:
        (run / CHECKPOINT).write_bytes(b"not a real checkpoint")
    return run


def section(markdown: str, title_start: str) -> str:
    """The text of the `## <title_start>...` section."""
    parts = re.split(r"^## ", markdown, flags=re.M)
    for part in parts:
        if part.startswith(title_start):
            return part
    raise AssertionError(f"no section {title_start!r} in report:\n{markdown}")


def table(markdown: str, title_start: str) -> tuple[list[str], dict[str, list[str]]]:
    """(header, {row label: [cells]}) of the first table in a section."""
    lines = [ln for ln in section(markdown, title_start).splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return header, rows


def plain(cell: str) -> str:
    return cell.replace("**", "").replace("<u>", "").replace("</u>", "")


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
