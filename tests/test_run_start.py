"""A run started afresh that fails before its first checkpoint, at whatever stage and whatever
stopped it (a user's mistake, a full disk, a bug), leaves nothing of its own: the corrected
command on the same out= starts afresh (after Ctrl-C, which keeps what was written for
resume=true: tests/test_run_messages.py, it does too). A resumed run's files, an overwritten run
and files that were there before stay as they should."""

from __future__ import annotations

import errno
import json

import pytest

from helpers import fail_once
from splitlab import build, loop
from splitlab.algorithms.base import Algorithm
from splitlab.cli import main
from splitlab.errors import UserError
from splitlab.rundir import CHECKPOINT

ARGS = ["dataset=digits", "model=mlp", "clients=2", "train_subset=200", "device=cpu", "--no-progress"]


STAGES = {
    # the run directory has config.yaml; writing partition.json finds the disk full
    "after config.yaml": (
        loop,
        "write_json",
        OSError(errno.ENOSPC, "No space left on device", "partition.json"),
        lambda path, *_: path.name == "partition.json",
        1,
    ),
    # config.yaml and partition.json are written; a mistake found as the trackers start
    "after partition.json": (loop, "_callbacks", UserError("a mistake found late"), lambda *_: True, 2),
    # a mistake found while the roles are built (before the directory is touched)
    "building the roles": (build, "Roles", UserError("a mistake found late"), lambda *_: True, 2),
    # a bug in round 1, before the first checkpoint (taken every 60 s by default)
    "in round 1": (Algorithm, "run_round", RuntimeError("a bug"), lambda *_: True, None),
}


@pytest.mark.parametrize("stage", STAGES)
def test_a_run_that_fails_before_its_first_checkpoint_leaves_nothing_and_the_rerun_works(
    stage, tmp_path, monkeypatch, capsys
):
    owner, name, error, when, code = STAGES[stage]
    args = ["run", *ARGS, "rounds=2", f"out={tmp_path / 'run'}"]
    with monkeypatch.context() as patch:
        fail_once(patch, owner, name, error, when)
        if code is None:
            with pytest.raises(type(error)):
                main(args)
        else:
            assert main(args) == code
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()  # no run directory: it made it, and it is gone
    assert main(args) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds_completed"] == 2


def test_what_was_there_before_stays_and_overwrite_and_resume_still_hold(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    args = ["run", *ARGS, f"out={out}"]
    with monkeypatch.context() as patch:
        fail_once(patch, Algorithm, "run_round", UserError("late"))
        assert main([*args, "rounds=2"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # only what was there
    assert main([*args, "rounds=2"]) == 0
    with monkeypatch.context() as patch:  # overwrite=true: the old run is replaced, the failed new one leaves nothing
        fail_once(patch, Algorithm, "run_round", UserError("late"))
        assert main([*args, "rounds=2", "overwrite=true"]) == 2
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    checkpointed = [*args, "rounds=3", "checkpoint_every=0", "overwrite=true"]
    with monkeypatch.context() as patch:  # after a checkpoint: kept for resume=true
        fail_once(patch, Algorithm, "run_round", UserError("late"), lambda self, rnd, clients: rnd == 2)
        assert main(checkpointed) == 2
    assert (out / CHECKPOINT).exists() and (out / "config.yaml").exists()
    capsys.readouterr()
    assert main([*checkpointed[:-1], "resume=true"]) == 0
    assert "starting again" not in capsys.readouterr().err
    assert json.loads((out / "summary.json").read_text())["rounds_completed"] == 3
