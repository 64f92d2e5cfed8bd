"""Issue 12: bad input is refused with one line, nothing is lost and nothing is silent."""

from __future__ import annotations

import copy

import pytest
import torch

from splitlab.cli import main
from splitlab.config import load_config_file, parse_overrides
from splitlab.errors import NonFiniteStep, UserError


@pytest.mark.parametrize(
    "setting, named",
    [
        ({"lr": float("inf")}, "lr"),
        ({"weight_decay": float("inf")}, "weight_decay"),
        ({"lr": "inf"}, "lr"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**32}, "seed"),
        ({"clients": True}, "clients"),
        ({"rounds": False}, "rounds"),
    ],
)
def test_bad_numbers_are_refused_up_front(setting, named):
    with pytest.raises(UserError, match=named):
        resolve_config(setting)


def test_booleans_and_largest_seed_still_accepted():
    config = resolve_config({"seed": 2**32 - 1, "resume": True})
    assert config.run.seed == 2**32 - 1 and config.run.resume is True


def test_duplicate_key_on_the_command_line_is_refused():
    with pytest.raises(UserError, match="'lr' is given twice"):
        parse_overrides(["lr=1", "rounds=2", "lr=2"])


def test_duplicate_key_in_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1\nrounds: 2\nlr: 2\n")
    with pytest.raises(UserError, match="'lr' is given twice"):
        load_config_file(path)


def test_cli_gives_one_line_and_exit_2(capsys):
    assert main(["run", "lr=.inf", "rounds=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lr" in err


# --- run directory: lock, divergence, resume, overwrite, temp files, umask, out= -------------

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from helpers import quick  # noqa: E402
from splitlab import rundir  # noqa: E402
from splitlab.engine import build, run  # noqa: E402
from splitlab.io import write_json  # noqa: E402
from splitlab.resolve import resolve_config  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


def cli(**overrides) -> list[str]:
    return [f"{k}={v}" for k, v in quick(**overrides).items()]


def test_second_writer_is_refused_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from splitlab import rundir\n"
            "with rundir.locked(pathlib.Path(sys.argv[1])):\n print('ready', flush=True); sys.stdin.read()",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        assert main(["run", *cli(rounds=1, out=out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"PID {holder.pid}" in err and "in use" in err
        assert not (out / "config.yaml").exists()
    finally:
        holder.kill()
        holder.wait()
    # the holder died without cleaning up: its lock is taken over
    assert run(quick(rounds=1, out=str(out)), progress=False)["rounds_completed"] == 1


@pytest.mark.parametrize("value", [1e30, float("nan")])
def test_a_non_finite_server_step_is_refused_before_the_optimizer_steps(value):
    """Smashed data of 1e30 (a gradient norm that overflows) or NaN: NonFiniteStep, and the
    server's model and optimizer are as before (then an honest step goes on from them); so where
    each step is checked (as over a network, where the client whose data it was is dropped)."""
    experiment = build(quick(clients=2, train_subset=100))
    experiment.roles.server.checks_each_step = True
    server, client = experiment.algorithm.server, experiment.algorithm.client(0)
    client.begin_round(0)
    sent = client.forward(0)
    server.train_step(sent["smashed"], sent["labels"])  # Adam has moments to lose
    before = copy.deepcopy(server.state_dict())
    with pytest.raises(NonFiniteStep) as refused:
        server.train_step(torch.full_like(sent["smashed"], value), sent["labels"])
    assert refused.value.what == ("gradient norm" if value == 1e30 else "loss")
    torch.testing.assert_close(server.state_dict(), before, rtol=0, atol=0)
    assert torch.isfinite(server.train_step(sent["smashed"], sent["labels"])["loss"])


def test_in_process_a_non_finite_server_step_is_found_once_at_the_end_of_the_round():
    """In process no figure is read per step (no host sync): the round's first non-finite one
    stops it at end_round, as the loop reports (training diverged in that round)."""
    experiment = build(quick(clients=2, train_subset=100))
    assert not experiment.roles.server.checks_each_step
    server, client = experiment.algorithm.server, experiment.algorithm.client(0)
    client.begin_round(0)
    sent = client.forward(0)
    server.train_step(sent["smashed"], sent["labels"])
    server.train_step(torch.full_like(sent["smashed"], 1e30), sent["labels"])
    server.train_step(torch.full_like(sent["smashed"], float("nan")), sent["labels"])
    with pytest.raises(NonFiniteStep) as diverged:
        server.end_round()
    assert (diverged.value.what, diverged.value.value) == ("gradient norm", float("inf"))
    server.end_round()  # the figures were read: the next round starts afresh


def test_non_finite_loss_stops_with_exit_3_and_strict_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["run", *cli(optimizer="sgd", lr=1e6, rounds=3, out=out), "--no-progress"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "diverged" in err and "round 1" in err  # caught before any step: inf or nan
    assert not (out / "summary.json").exists()
    with pytest.raises(ValueError):
        write_json(tmp_path / "x.json", {"loss": float("nan")})


@pytest.mark.parametrize("content", [None, "", "lr: [1, 2", "garbage", "lr: abc\n", "- a\n- b\n"])
def test_resume_refuses_missing_or_unusable_config_yaml(tmp_path, content):
    out = tmp_path / "run"
    run(quick(rounds=1, out=str(out)), progress=False)
    (out / "summary.json").unlink()  # as if killed before the end
    if content is None:
        (out / "config.yaml").unlink()
    else:
        (out / "config.yaml").write_text(content)
    with pytest.raises(UserError, match="cannot resume.*config.yaml.*overwrite=true"):
        run(quick(rounds=1, out=str(out), resume=True), progress=False)


def test_overwrite_removes_everything_written_and_stale_temp_files(tmp_path):
    out = tmp_path / "run"
    run(quick(rounds=1, out=str(out)), progress=False)
    for name in ("evaluation.json", ".summary.json.abc123.tmp", "tensorboard/events"):
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text("old")
    (out / "notes.txt").write_text("mine")
    run(quick(rounds=1, out=str(out), overwrite=True), progress=False)
    names = {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert not names & {"evaluation.json", ".summary.json.abc123.tmp", "tensorboard", "tensorboard/events"}
    assert "notes.txt" in names and "summary.json" in names and ".lock" not in names


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        write_json(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("make, under", [("file", ""), ("file", "/x/y")])
def test_out_that_cannot_be_a_directory_is_refused_before_work(tmp_path, capsys, make, under):
    (tmp_path / make).write_text("")
    assert main(["run", *cli(out=f"{tmp_path / make}{under}")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "file" in err


def test_out_in_proc_is_refused():
    with pytest.raises(UserError, match="out '/proc/splitlab_x'"):
        rundir.make_out_dir(Path("/proc/splitlab_x"))


# --- first use -------------------------------------------------------------------------------


def test_flags_anywhere_among_pairs_and_one_line_per_round_without_terminal(tmp_path, capfd):
    pairs = cli(rounds=2, out=tmp_path / "quiet")
    assert main(["run", *pairs[:2], "--no-progress", *pairs[2:]]) == 0  # in process: stderr is not a terminal
    assert json.loads((tmp_path / "quiet" / "summary.json").read_text())["rounds_completed"] == 2
    assert "round 1/2" not in capfd.readouterr().err  # --no-progress honoured after the first pair
    assert main(["run", *cli(rounds=2, out=tmp_path / "lines")]) == 0
    lines = [line.split("  ")[0] for line in capfd.readouterr().err.splitlines()]
    # one line per round; "round 1/2: 17% (2 of 12 client batches)" lines too where a round outlasts
    # logs.LINE_SECONDS (seen on a loaded machine)
    assert [line for line in lines if ":" not in line] == ["round 1/2", "round 2/2"]
    assert all(line.startswith(("round 1/2", "round 2/2")) for line in lines)


def test_algorithms_table_shows_whole_first_sentences_and_yaml_defaults(capsys):
    from splitlab.catalog import first_sentence

    assert (
        first_sentence("FedAvg (McMahan et al. 2017): each client trains. More.")
        == "FedAvg (McMahan et al. 2017): each client trains."
    )
    assert main(["algorithms"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "McMahan et al. 2017" in shown and "server_lr=null" in shown and "None" not in shown


def test_a_run_is_repeated_from_its_config_yaml_into_a_new_out(tmp_path):
    run(quick(rounds=1, out=str(tmp_path / "a")), progress=False)
    assert main(["run", "--config", str(tmp_path / "a" / "config.yaml"), f"out={tmp_path / 'b'}", "--no-progress"]) == 0
    first, second = (json.loads((tmp_path / d / "summary.json").read_text()) for d in "ab")
    assert first["final_accuracy"] == second["final_accuracy"]


def test_listing_tables_do_not_import_torch():
    """The three listings, one after another in one fresh interpreter."""
    probe = (
        "import sys; from splitlab.cli import main\n"
        "for command in ('datasets', 'models', 'algorithms'): main([command])\n"
        "print('torch' in sys.modules, 'sklearn' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "False False"


def test_the_catalog_of_models_and_algorithms_is_up_to_date():
    """catalog.json is what the live registries give; regenerate it with `python -m splitlab.catalog`."""
    from splitlab import catalog

    assert catalog.load() == catalog.generate(), "run: python -m splitlab.catalog"
