"""splitlab.units: one byte formatter and one rounds/GiB-to-target for the summary and the report."""

from __future__ import annotations

from splitlab.units import format_bytes, to_target


def test_format_bytes_picks_adaptive_binary_units():
    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.500 KiB"
    assert format_bytes(13_151_200) == "12.54 MiB"
    assert format_bytes(403_233_912) == "384.6 MiB"
    assert format_bytes(3 * 2**30) == "3.000 GiB"
    assert format_bytes(2**29, 2**27) == "512.0 ± 128.0 MiB"


def test_to_target_first_evaluated_round_and_its_gib():
    rows = [
        {"round": 1, "test_accuracy": 0.5, "comm_gib": 0.1},
        {"round": 2, "test_accuracy": 0.7, "comm_bytes": 2**30},  # older rows: bytes only
        {"round": 3, "test_accuracy": 0.9, "comm_gib": 0.3},
    ]
    assert to_target(rows, 0.6) == (2, 1.0)
    assert to_target(rows, 0.95) == (None, None)
    assert to_target(rows, None) == (None, None)
    assert to_target([{"round": 1, "test_accuracy": "x"}], 0.1) == (None, None)
    evaluated = [
        {"round": r, "test_accuracy": a, "comm_gib": 0.5 * r} for r, a in [(2, 0.3), (4, 0.5), (6, 0.45), (8, 0.7)]
    ]
    assert to_target(evaluated, 0.5) == (4, 2.0) and to_target(evaluated, 0.69) == (8, 4.0)  # evaluated rounds only


def test_run_summary_prints_adaptive_units(capsys):
    from splitlab import cli

    summary = {
        "algorithm": "sl",
        "dataset": "d",
        "model": "m",
        "cut": 1,
        "rounds_completed": 2,
        "stopped_by": "rounds",
        "final_accuracy": 0.5,
        "best_accuracy": 0.5,
        "best_round": 2,
        "final_f1": 0.1,
        "final_mcc": 0.1,
        "total_bytes": 3 * 2**20 + 600,
        "comm_bytes_by_kind": {"labels": 600, "smashed": 3 * 2**20},
        "wall_seconds": 1.0,
    }
    cli._print_summary(summary, {})
    out = capsys.readouterr().out
    assert "3.001 MiB" in out and "600 B" in out and "3.000 MiB" in out and "GiB" not in out
