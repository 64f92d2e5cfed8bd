"""What a killed atomic write leaves (splitlab.io): a temporary file or folder, or a folder export
renamed aside, recovered when a run directory is next taken (resume=true, overwrite=true, a new run):
the old export or the new one whole, never neither, and no leftover in the way."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import crash_before_round, quick
from splitlab import io
from splitlab.engine import run
from splitlab.rundir import CHECKPOINT

#: replaces folder SYS.ARGV[1] (holding "old" files) by one holding "new" ones, SIGKILLed at the
#: SYS.ARGV[2]-th step: 1 while writing, 2 before the old folder goes aside, 3 before the new one
#: moves in, 4 before the old one aside is removed; 5 ends normally
REPLACE_KILLED = """
import os, signal, sys
from pathlib import Path
from splitlab import io

at, steps = int(sys.argv[2]), [0]

def killed_at_step(real):
    def step(*args):
        steps[0] += 1
        if steps[0] == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args)
    return step

os.rename = killed_at_step(os.rename)
io.remove = killed_at_step(io.remove)
with io.atomic_folder(Path(sys.argv[1])) as tmp:
    for name in ("config.json", "weights.safetensors"):
        (tmp / name).write_text("new")
    killed_at_step(lambda: None)()
"""


def export(folder: Path) -> set[str]:
    """What each file of an export holds, as one set: {"old"} or {"new"} when it is whole."""
    return {(folder / name).read_text() for name in ("config.json", "weights.safetensors")}


@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
def test_a_folder_export_killed_at_any_step_of_its_replacement_is_the_old_or_the_new_one_whole(tmp_path, step):
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "weights.safetensors"):
        (hf / name).write_text("old")
    process = subprocess.run([sys.executable, "-c", REPLACE_KILLED, str(hf), str(step)], check=False)
    assert process.returncode == (0 if step == 5 else -signal.SIGKILL)
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "hf")
    assert len(left) == {1: 1, 2: 1, 3: 2, 4: 1, 5: 0}[step]  # the temporary folder, the old one aside
    io.recover(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert export(hf) == ({"old"} if step <= 3 else {"new"})


def test_recover_removes_temporary_files_and_folders_and_an_aside_beside_its_replacement(tmp_path):
    (tmp_path / ".summary.json.abc123xy.tmp").write_text("half")
    (tmp_path / ".hf.x.tmp").mkdir()
    (tmp_path / ".hf.x.tmp" / "config.json").write_text("{}")
    (tmp_path / "peft").mkdir()
    (tmp_path / ".peft.old.tmp").mkdir()
    (tmp_path / "kept.txt").write_text("mine")
    io.recover(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "peft"]


@pytest.fixture
def stopped_run(tmp_path, monkeypatch):
    """A run stopped after round 0's checkpoint, with a killed export's temporary folder in it."""
    config = quick(algorithm="sfl_v2", rounds=2, checkpoint_every=0, out=str(tmp_path / "run"))
    crash_before_round(1, config, monkeypatch)
    assert (tmp_path / "run" / CHECKPOINT).exists()
    (tmp_path / "run" / ".hf.x.tmp").mkdir()
    (tmp_path / "run" / ".hf.x.tmp" / "config.json").write_text("{}")
    return config


@pytest.mark.parametrize("how", ["resume", "overwrite"])
def test_a_run_holding_a_temporary_folder_resumes_or_is_overwritten(stopped_run, how):
    out = Path(stopped_run["out"])
    assert run({**stopped_run, how: True}, progress=False)["rounds_completed"] == 2
    assert not list(out.glob(io.TEMP_GLOB))
    (out / ".hf.x.tmp").mkdir()  # the finished run: resume=true reads its summary, overwrite=true runs again
    assert run({**stopped_run, how: True}, progress=False)["rounds_completed"] == 2
    assert not list(out.glob(io.TEMP_GLOB))
