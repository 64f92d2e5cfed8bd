"""Ctrl-C of a running `splitlab sweep`: it stops within seconds with one line saying how to
continue, leaves no lock and no half-written file, and the same command run again completes the
sweep, the interrupted runs resumed from their checkpoints. With worker processes the signal is a
real SIGINT to the command's whole process group, as a terminal sends it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from helpers import held_plugin, wait_for
from splitlab.algorithms.base import Algorithm
from splitlab.cli import main
from splitlab.rundir import CHECKPOINT

BASE = {"dataset": "digits", "model": "mlp", "clients": 2, "train_subset": 200, "device": "cpu"}
BASE |= {"checkpoint_every": 0, "rounds": 3, "eval_every": 5}
RUNS = ("seed=0", "seed=1")


def sweep_file(tmp_path: Path, **base) -> Path:
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump({"base": BASE | base, "axes": {"seed": [0, 1]}}))
    return path


def check_clean(sweep: Path) -> None:
    """No lock, no temporary file of an unfinished atomic write, and every JSON file whole."""
    assert sorted(p.name for pattern in (".lock", ".*.tmp") for p in sweep.rglob(pattern)) == []
    for path in sweep.rglob("*.json*"):
        text = path.read_text()
        for line in text.splitlines() if path.suffix == ".jsonl" else [text]:
            json.loads(line)


def check_one_line(err: str, finished: int) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"interrupted; {finished} of 2 runs finished in ") and lines[0].endswith(
        "to continue, run the same sweep command again (each unfinished run resumes from its last checkpoint)"
    )


def test_ctrl_c_in_a_sweep_run_in_process(tmp_path, monkeypatch, capsys):
    args = ["sweep", str(sweep_file(tmp_path)), "--out", str(tmp_path / "sweep"), "--no-progress"]
    original = Algorithm.run_round

    def ctrl_c(self, rnd, clients):
        if rnd == 2:
            raise KeyboardInterrupt
        return original(self, rnd, clients)

    with monkeypatch.context() as patch:
        patch.setattr(Algorithm, "run_round", ctrl_c)
        assert main(args) == 130
    check_one_line(capsys.readouterr().err, finished=0)
    check_clean(tmp_path / "sweep")
    assert (tmp_path / "sweep" / "seed=0" / CHECKPOINT).is_file()
    assert main(args) == 0
    assert all((tmp_path / "sweep" / name / "summary.json").is_file() for name in RUNS)
    check_clean(tmp_path / "sweep")


def test_ctrl_c_stops_the_worker_processes_cleanly(tmp_path, monkeypatch):
    """Both runs checkpointed round 0 and wait before round 1 (a plugin algorithm, imported by
    each worker process from the folder the command starts in) when Ctrl-C comes."""
    held, hold = held_plugin(tmp_path, "fedavg")
    monkeypatch.syspath_prepend(str(tmp_path))  # for the run again in this process
    sweep = tmp_path / "sweep"
    spec = sweep_file(tmp_path, **held)
    cli = [sys.executable, "-m", "splitlab", "sweep", str(spec), "--out", str(sweep), "--no-progress"]
    process = subprocess.Popen(
        [*cli, "--jobs", "2"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # as a terminal's foreground job has it: a test run started in the background (`cmd &` in a
        # script) ignores SIGINT, and a child inherits that, so Ctrl-C would never reach the sweep
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_for(process, sweep, f"*/{CHECKPOINT}", count=2)
    os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: to every process of the group
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    check_one_line(err, finished=0)
    check_clean(sweep)
    hold.unlink()
    assert main(cli[3:]) == 0  # again (here, in this process)
    assert all((sweep / name / "summary.json").is_file() for name in RUNS)
    check_clean(sweep)
