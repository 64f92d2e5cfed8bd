"""The planted sweep directory shared by the report tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from runfiles import fabricate


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """5 experiments x 2 seeds with planted accuracies, one incomplete and one failed run."""
    sweep = tmp_path / "sweep"
    c = {"algorithm": "sfl_v1", "cut": 1}
    fabricate(sweep, "a1s0", {**c, "seed": 0}, [0.3, 0.5])
    fabricate(sweep, "a1s1", {**c, "seed": 1}, [0.76, 0.7])  # reaches 0.75 in round 1, then drops
    c = {"algorithm": "sfl_v1", "cut": 2}
    fabricate(sweep, "a2s0", {**c, "seed": 0}, [0.6, 0.8], gib_per_round=0.5)
    fabricate(sweep, "a2s1", {**c, "seed": 1}, [0.6, 0.8], gib_per_round=0.25)
    c = {"algorithm": "sfl_v2", "cut": 1}
    fabricate(sweep, "b1s0", {**c, "seed": 0}, [0.8, 0.9])
    fabricate(sweep, "b1s1", {**c, "seed": 1}, [0.95, 0.95])
    c = {"algorithm": "sfl_v2", "cut": 2}
    fabricate(sweep, "b2s0", {**c, "seed": 0}, [0.85, 0.85])
    fabricate(sweep, "b2s1", {**c, "seed": 1}, [0.2], finished=False)  # interrupted after round 1
    fabricate(sweep, "b2s2", {**c, "seed": 2}, [], error="Traceback ...\nRuntimeError: boom in round 3\n")
    c = {"algorithm": "fedavg", "cut": 1}
    fabricate(sweep, "f1s0", {**c, "seed": 0}, [0.4, 0.4])
    fabricate(sweep, "f1s1", {**c, "seed": 1}, [0.42, 0.42])
    return sweep
