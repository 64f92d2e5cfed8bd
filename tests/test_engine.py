"""The round loop: files, determinism, kill-and-resume, the communication budget."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    assert_same_run,
    crash_before_round,
    global_weights,
    held_plugin,
    quick,
    sigkilled_after_first_checkpoint,
    train,
    without_timing,
)
from splitlab import codec
from splitlab.algorithms.sfl_v2 import SFLV2
from splitlab.checkpoints import Checkpointer
from splitlab.cli import main
from splitlab.engine import build, run
from splitlab.errors import UserError
from splitlab.io import read_jsonl
from splitlab.rundir import CHECKPOINT


def test_run_writes_every_file_with_the_promised_fields(tmp_path):
    summary = run(quick(algorithm="sfl_v2", rounds=3, eval_every=2, out=str(tmp_path)), progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.yaml",
        "metrics.jsonl",
        "partition.json",
        "summary.json",
        "weights.safetensors",
    ]
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [row["round"] for row in rows] == [2, 3]  # every 2 rounds, and after the last
    for key in (
        "test_accuracy",
        "test_loss",
        "test_f1",
        "test_mcc",
        "comm_bytes",
        "comm_bytes_by_kind",
        "wall_seconds",
        "train_loss",
        "round_compute_seconds",
    ):
        assert key in rows[-1]
    assert rows[-1]["comm_bytes"] == sum(rows[-1]["comm_bytes_by_kind"].values())
    assert set(rows[-1]["round_compute_seconds"]) == {"client", "server"}
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["final_accuracy"] == rows[-1]["test_accuracy"] > 0.5
    partition = json.loads((tmp_path / "partition.json").read_text())
    assert sum(partition["sizes"]) == 300


def test_weights_file_is_the_global_model_under_unsplit_names(tmp_path):
    run(quick(algorithm="sfl_v1", cut=2, out=str(tmp_path)), progress=False)
    saved = load_file(tmp_path / "weights.safetensors")
    expected = global_weights(train(2, **quick(algorithm="sfl_v1", cut=2)))
    assert (
        saved.keys()
        == expected.keys()
        == {"fc1.1.weight", "fc1.1.bias", "fc2.0.weight", "fc2.0.bias", "out.weight", "out.bias"}
    )
    for name in saved:
        assert torch.equal(saved[name], expected[name])


def test_same_seed_same_metrics_other_seed_other_metrics(tmp_path):
    rows = []
    for name, seed in [("a", 0), ("b", 0), ("c", 1)]:
        run(quick(algorithm="sfl_v2", seed=seed, out=str(tmp_path / name)), progress=False)
        rows.append(without_timing(read_jsonl(tmp_path / name / "metrics.jsonl")))
    assert rows[0] == rows[1]
    assert rows[0] != rows[2]


def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    config = quick(algorithm="sfl_v2", rounds=4, optimizer="adam", partition="dirichlet:0.5", checkpoint_every=0)
    run({**config, "out": str(tmp_path / "whole")}, progress=False)

    crash_before_round(2, {**config, "out": str(tmp_path / "cut")}, monkeypatch)
    assert codec.decode((tmp_path / "cut" / CHECKPOINT).read_bytes())["loop"]["round"] == 2

    with pytest.raises(UserError, match="already holds a run; use resume=true"):
        run({**config, "out": str(tmp_path / "cut")}, progress=False)
    run({**config, "out": str(tmp_path / "cut"), "resume": True}, progress=False)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


def test_sigkilled_cli_run_resumes_to_the_uninterrupted_result(tmp_path, monkeypatch):
    """SFL-V1 (a plugin's copy that waits before round 1 while a file exists) SIGKILLed after its
    first checkpoint: the same command line resumes it to the uninterrupted run's end."""
    held, hold = held_plugin(tmp_path, "sfl_v1")
    monkeypatch.syspath_prepend(str(tmp_path))  # for the runs in this process
    args = [
        *(f"{k}={v}" for k, v in held.items()),
        "dataset=digits",
        "model=mlp",
        "clients=4",
        "rounds=3",
        "device=cpu",
        "train_subset=400",
        "partition=dirichlet:1",
        "checkpoint_every=0",
    ]
    killed = tmp_path / "killed"
    sigkilled_after_first_checkpoint(tmp_path, args, killed)
    hold.unlink()
    # the same command line resumes it, and runs it whole, in this process (a process's start-up saved)
    assert main(["run", "--no-progress", *args, f"out={killed}", "resume=true"]) == 0
    assert main(["run", "--no-progress", *args, f"out={tmp_path / 'whole'}"]) == 0
    assert_same_run(tmp_path / "whole", killed)


def test_resume_refuses_a_changed_config(tmp_path):
    config = quick(algorithm="sfl_v2", rounds=1, out=str(tmp_path))
    run(config, progress=False)
    with pytest.raises(UserError, match="cannot resume .*lr=0.5 differs from the stored 0.001"):
        run({**config, "lr": 0.5, "resume": True}, progress=False)


def test_finished_run_resumed_returns_its_summary_without_training(tmp_path, monkeypatch):
    config = quick(algorithm="sfl_v2", rounds=1, out=str(tmp_path))
    summary = run(config, progress=False)
    monkeypatch.setattr(SFLV2, "train_round", lambda *a: pytest.fail("trained again"))
    assert run({**config, "resume": True}, progress=False) == summary


def test_overwrite_replaces_a_run(tmp_path):
    config = quick(algorithm="sfl_v2", rounds=1, out=str(tmp_path))
    first = run(config, progress=False)
    second = run({**config, "overwrite": True, "rounds": 2}, progress=False)
    assert first["rounds_completed"] == 1 and second["rounds_completed"] == 2


def test_comm_budget_stops_the_run_once_spent(tmp_path):
    # One sfl_v2 round here moves 794,400 bytes (see algorithms/test_bytes_per_round.py):
    # a budget of 1.5 rounds stops after 2.
    budget_gib = 1.5 * 794_400 / 2**30
    summary = run(
        quick(algorithm="sfl_v2", rounds=10, eval_every=5, comm_budget_gib=budget_gib, out=str(tmp_path)),
        progress=False,
    )
    assert summary["stopped_by"] == "comm_budget"
    assert summary["rounds_completed"] == 2
    assert summary["total_bytes"] == 2 * 794_400
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["round"] == 2  # evaluated where it stopped


def test_a_run_from_before_a_new_key_existed_still_resumes(tmp_path, monkeypatch):
    config = quick(algorithm="sfl_v2", rounds=2, out=str(tmp_path))
    crash_before_round(1, config, monkeypatch)
    stored = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(
        "".join(line + "\n" for line in stored.splitlines() if not line.startswith("local_steps:"))
    )
    assert run({**config, "resume": True}, progress=False)["rounds_completed"] == 2


def test_a_checkpoint_snapshot_holds_the_loop_at_most_its_share_of_the_time(tmp_path):
    # checkpoint_every is a floor: after a snapshot that took s seconds, the next waits s / SNAPSHOT_SHARE
    experiment = build(quick(algorithm="fsl_sage", checkpoint_every=1e-9, out=str(tmp_path)))
    checkpoints = Checkpointer(experiment)
    checkpoints.maybe_save({"round": 1})
    checkpoints.wait()
    assert codec.decode((tmp_path / CHECKPOINT).read_bytes())["loop"] == {"round": 1}
    checkpoints.maybe_save({"round": 2})  # sooner than the first one's cost allows: skipped
    checkpoints.wait()
    assert codec.decode((tmp_path / CHECKPOINT).read_bytes())["loop"] == {"round": 1}
