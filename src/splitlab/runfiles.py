"""The files of a run directory, named once for the engine, sweeps and reports (no torch import)."""

from __future__ import annotations

CHECKPOINT = "checkpoint.safetensors"
RUN_FILES = (
    "config.yaml",
    "partition.json",
    "metrics.jsonl",
    "summary.json",
    CHECKPOINT,
    "weights.safetensors",
    "clients.safetensors",
)
#: A finished run's curves, drawn by `splitlab run` (splitlab.experiments.plots.plot_run).
CURVES = "curves.png"
