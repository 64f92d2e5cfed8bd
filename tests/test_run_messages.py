"""What a run says is true: after an interruption, what was kept and what resume=true will do;
resume=true where there is nothing to resume, or a finished run's damaged summary, is one line."""

from __future__ import annotations

import signal
import subprocess
import sys

from helpers import held_plugin, wait_for
from splitlab.algorithms.base import Algorithm
from splitlab.cli import main
from splitlab.rundir import CHECKPOINT, CURVES

ARGS = ["dataset=digits", "model=mlp", "clients=2", "train_subset=200", "device=cpu", "--no-progress"]


def interrupted_at(round_number: int, args: list[str], monkeypatch, capsys) -> str:
    """The CLI's stderr when Ctrl-C comes at the start of round `round_number` (counted from 1)."""
    original = Algorithm.run_round

    def crash(self, rnd, clients):
        if rnd + 1 == round_number:
            raise KeyboardInterrupt
        return original(self, rnd, clients)

    with monkeypatch.context() as patch:
        patch.setattr(Algorithm, "run_round", crash)
        assert main(["run", *args]) == 130
    return capsys.readouterr().err


def test_ctrl_c_before_the_first_checkpoint_says_nothing_was_kept(tmp_path, monkeypatch, capsys):
    args = [*ARGS, "rounds=4", f"out={tmp_path}/run"]  # checkpoint_every=60: no checkpoint in a short run
    err = interrupted_at(3, args, monkeypatch, capsys)
    assert "nothing to continue from was saved" in err and "resume=true will start again at round 1" in err
    assert err.count("\n") == 1 and not (tmp_path / "run" / ".lock").exists()
    assert main(["run", *args, "resume=true"]) == 0
    assert "holds no checkpoint: starting again at round 1" in capsys.readouterr().err
    again = [*ARGS, "rounds=4", f"out={tmp_path}/again"]
    interrupted_at(3, again, monkeypatch, capsys)  # or the same command again, without resume=true
    assert main(["run", *again]) == 0
    assert "it stopped before its first checkpoint" in capsys.readouterr().err


def test_a_run_draws_its_curves_and_says_where_its_files_are(tmp_path, capsys, monkeypatch):
    """curves.png beside metrics.jsonl, once the run has finished (never for an interrupted one)."""
    interrupted_at(2, [*ARGS, "rounds=3", f"out={tmp_path}/cut"], monkeypatch, capsys)
    assert not (tmp_path / "cut" / CURVES).exists()
    assert main(["run", *ARGS, "rounds=3", f"out={tmp_path}/run"]) == 0
    assert f"written to {tmp_path}/run  (curves: {tmp_path}/run/{CURVES})" in capsys.readouterr().out
    assert (tmp_path / "run" / CURVES).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_after_a_checkpoint_names_its_round(tmp_path, monkeypatch, capsys):
    args = [*ARGS, "rounds=4", "checkpoint_every=0", f"out={tmp_path}/run"]
    err = interrupted_at(3, args, monkeypatch, capsys)
    assert "kept: the checkpoint after round 2" in err and "continue from round 3" in err


def test_resume_where_there_is_no_run_is_refused(tmp_path, capsys):
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("not a run")
    for out in ("empty", "foreign"):
        assert main(["run", *ARGS, f"out={tmp_path / out}", "resume=true"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "holds no run" in err
    assert not (tmp_path / "empty").exists()


def test_a_finished_run_with_a_damaged_summary_is_refused_in_one_line(tmp_path, capsys):
    args = [*ARGS, "rounds=1", f"out={tmp_path}/run"]
    assert main(["run", *args]) == 0
    for damage in (b"\x00\xff garbage", b"[1, 2]", b"{}"):
        (tmp_path / "run" / "summary.json").write_bytes(damage)
        capsys.readouterr()
        assert main(["run", *args, "resume=true"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "summary.json is unreadable" in err


def test_sigterm_ends_a_run_as_ctrl_c_does(tmp_path):
    """A run waiting before round 1 (a plugin's copy of its algorithm) after its first checkpoint."""
    out = tmp_path / "run"
    held, _ = held_plugin(tmp_path, "sfl_v2")
    keys = [*ARGS, *(f"{k}={v}" for k, v in held.items()), "rounds=3", "checkpoint_every=0", f"out={out}"]
    cli = [sys.executable, "-m", "splitlab", "run", *keys]
    process = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_for(process, out, CHECKPOINT)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate()
    assert process.returncode == 130, err
    assert "kept: the checkpoint after round" in err and not (out / ".lock").exists()
