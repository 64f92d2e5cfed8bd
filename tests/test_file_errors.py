"""An OS error on a command's files (full disk, quota, read-only, forbidden, a file in the way) is
one line naming the file, the cause and what was kept; exit code 1; no lock left; nothing lost.
Failures are injected where the commands write: at a run's start, mid-run, in the background
checkpoint writer, and in sweep, report, attack, advise and certs."""

from __future__ import annotations

import errno
import json
import os

import pytest

from splitlab import callbacks, checkpoints, loop
from splitlab.cli import main
from splitlab.io import TEMP_GLOB
from splitlab.net import certs
from splitlab.rundir import CHECKPOINT

RUN = ["run", "dataset=digits", "model=mlp", "clients=2", "train_subset=200", "device=cpu", "--no-progress"]


def failing(monkeypatch, module, name: str, code: int, after: int = 0) -> None:
    """`module.name` raises OSError(code) from its call number `after` + 1 on."""
    original, calls = getattr(module, name), []

    def write(path, *args, **kwargs):
        calls.append(path)
        if len(calls) > after:
            raise OSError(code, os.strerror(code), str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(module, name, write)


def one_line_exit_1(capsys, argv: list[str], *expected: str) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot write "), err
    for text in expected:
        assert text in err, err
    return err


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EISDIR, errno.ENOTDIR, errno.EDQUOT])
def test_a_failure_at_the_start_of_a_run(tmp_path, monkeypatch, capsys, code):
    failing(monkeypatch, loop, "write_yaml", code)
    out = tmp_path / "run"
    one_line_exit_1(capsys, [*RUN, "rounds=2", f"out={out}"], "config.yaml", os.strerror(code))
    assert not (out / ".lock").exists() and not list(out.glob(TEMP_GLOB))


def test_a_failure_mid_run_says_which_checkpoint_was_kept_and_resume_finishes(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    with monkeypatch.context() as patch:
        failing(patch, callbacks, "write_jsonl", errno.ENOSPC, after=2)  # rounds 1 and 2 logged, round 3 fails
        one_line_exit_1(
            capsys, [*RUN, "rounds=4", "checkpoint_every=0", f"out={out}"], "metrics.jsonl", "checkpoint after round 2"
        )
    assert not (out / ".lock").exists()
    assert main([*RUN, "rounds=4", "checkpoint_every=0", f"out={out}", "resume=true"]) == 0
    assert [row["round"] for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())] == [1, 2, 3, 4]


def test_a_failure_in_the_background_checkpoint_writer(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    failing(monkeypatch, checkpoints, "write_safetensors", errno.EDQUOT)
    one_line_exit_1(capsys, [*RUN, "rounds=3", "checkpoint_every=0", f"out={out}"], CHECKPOINT, "quota")
    assert not (out / ".lock").exists() and not (out / CHECKPOINT).exists()


def test_a_failure_in_sweep_report_attack_advise_and_certs(tmp_path, monkeypatch, capsys):
    from splitlab.audit import probes
    from splitlab.audit import run as audit
    from splitlab.experiments import report, sweep

    (tmp_path / "grid.yaml").write_text(
        "base: {dataset: digits, model: mlp, clients: 2, rounds: 1, train_subset: 200, device: cpu, record: 10}\n"
        "axes: {seed: [0]}\n"
    )
    grid = [str(tmp_path / "grid.yaml"), "--out", str(tmp_path / "sweep"), "--no-progress"]
    with monkeypatch.context() as patch:
        failing(patch, sweep, "write_text", errno.ENOSPC)
        one_line_exit_1(capsys, ["sweep", *grid], "sweep.yaml", "No space left")
    assert not (tmp_path / "sweep" / ".lock").exists()
    assert main(["sweep", *grid]) == 0
    with monkeypatch.context() as patch:
        failing(patch, report, "write_text", errno.EROFS)
        one_line_exit_1(capsys, ["report", str(tmp_path / "sweep")], "Read-only file system")
    run_dir = next(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    with monkeypatch.context() as patch:
        failing(patch, audit, "write_json", errno.EACCES)
        one_line_exit_1(capsys, ["attack", str(run_dir), "attack=label_leak"], "attack.json", "Permission denied")
    with monkeypatch.context() as patch:
        failing(patch, probes, "write_json", errno.ENOSPC)
        probe = ["dataset=digits", "model=mlp", "rounds=1", "clients=2", "train_subset=200", "test_subset=200"]
        one_line_exit_1(
            capsys, ["advise", *probe, "aux=60", "targets=40", "epochs=1", f"out={tmp_path / 'adv'}"], "advise.json"
        )
    with monkeypatch.context() as patch:
        failing(patch, certs, "_write", errno.ENOSPC)
        one_line_exit_1(capsys, ["certs", f"out={tmp_path / 'certs'}"], "certs", "No space left")
