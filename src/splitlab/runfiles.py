"""The files of a run directory, named once for the engine, sweeps and reports (no torch import)."""

from __future__ import annotations

CHECKPOINT = "checkpoint.safetensors"
#: The pickle-based checkpoint of splitlab before the roles: refused on resume, removed on overwrite.
LEGACY_CHECKPOINT = "checkpoint.pt"
RUN_FILES = (
    "config.yaml",
    "partition.json",
    "metrics.jsonl",
    "summary.json",
    CHECKPOINT,
    LEGACY_CHECKPOINT,
    "weights.safetensors",
    "clients.safetensors",
)
