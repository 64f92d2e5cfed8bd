"""SplitGP beyond training: the paper's per-client evaluation (Section VI) and its inference-time
model (Section V). Training itself is `splitlab.algorithms.splitgp`."""

from __future__ import annotations

from splitlab.config import parse_settings

__all__ = ["parse_settings"]
