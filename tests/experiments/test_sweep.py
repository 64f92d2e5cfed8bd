"""Sweep files and running them (splitlab.experiments.grid, sweep); the real-engine tests run a
tiny grid (2 algorithms x 2 cuts x 2 seeds on digits)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from runfiles import PNG_SIGNATURE, plain, read_csv, table

from splitlab.errors import UserError
from splitlab.experiments import SweepFailed, collect_results, expand_sweep, run_name, run_sweep, write_report
from splitlab.experiments.tables import mean_std
from splitlab.rundir import CHECKPOINT

# --------------------------------------------------------------------------- sweep files

BASE = {
    "dataset": "digits",
    "model": "mlp",
    "clients": 3,
    "rounds": 2,
    "train_subset": 300,
    "device": "cpu",
    "checkpoint_every": 0,
}


def write_sweep(tmp_path: Path, spec, name: str = "tiny.yaml") -> Path:
    path = tmp_path / name
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    return path


def test_expand_grid_order_names_and_out(tmp_path: Path):
    path = write_sweep(
        tmp_path,
        {
            "base": BASE,
            "axes": {"algorithm": ["sfl_v1", "sfl_v2"], "cut": [1, 2], "partition": ["iid", "dirichlet:0.1"]},
        },
    )
    runs = expand_sweep(path, out=tmp_path / "o")
    names = [n for n, _ in runs]
    assert len(runs) == 8 and len(set(names)) == 8
    assert names[0] == "algorithm=sfl_v1__cut=1__partition=iid"
    assert names[1] == "algorithm=sfl_v1__cut=1__partition=dirichlet-0.1"  # last axis varies fastest
    assert names[-1] == "algorithm=sfl_v2__cut=2__partition=dirichlet-0.1"
    name, cfg = runs[1]
    assert cfg["partition"] == "dirichlet:0.1" and cfg["cut"] == 1 and cfg["model"] == "mlp"
    assert cfg["out"] == str(tmp_path / "o" / name)
    assert expand_sweep(path)[0][1]["out"] == str(Path("runs") / "tiny" / names[0])  # default runs/<stem>
    assert expand_sweep(path, out=tmp_path / "o") == runs  # deterministic


def test_run_names_are_filesystem_safe():
    assert run_name({"algorithm": "sfl_v2", "cut": 1, "seed": 0}) == "algorithm=sfl_v2__cut=1__seed=0"
    assert (
        run_name({"partition": "dirichlet:0.1", "lr": 0.001, "x": True, "d": "a/b c"})
        == "partition=dirichlet-0.1__lr=0.001__x=true__d=a-b-c"
    )
    long = run_name({"data_dir": "x" * 300})
    assert len(long) <= 200 and long == run_name({"data_dir": "x" * 300})
    assert long != run_name({"data_dir": "x" * 299 + "y"})
    for name in (long, run_name({"p": "../..", "q": '*?<>|"\\'})):
        assert re.fullmatch(r"[A-Za-z0-9._+=-]+", name) and not name.startswith(".")


def test_overrides_exclude_and_any_of(tmp_path: Path):
    spec = {
        "base": {**BASE, "optimizer": "adam"},
        "axes": {"algorithm": ["sfl_v1", "sfl_v2", "fedavg"], "cut": [1, 2], "seed": [0]},
        "exclude": [{"algorithm": "fedavg", "cut": 2}],
        "overrides": [
            {"when": {"algorithm": "fedavg"}, "set": {"optimizer": "sgd", "lr": 0.01}},
            {"when": {"algorithm": ["sfl_v1", "sfl_v2"], "cut": 2}, "set": {"batch_size": 32}},
            {"when": {"optimizer": "sgd"}, "set": {"momentum": 0.5}},  # sees earlier overrides
        ],
    }
    runs = dict(expand_sweep(spec, out=tmp_path))
    assert sorted(runs) == sorted(
        [
            "algorithm=sfl_v1__cut=1__seed=0",
            "algorithm=sfl_v1__cut=2__seed=0",
            "algorithm=sfl_v2__cut=1__seed=0",
            "algorithm=sfl_v2__cut=2__seed=0",
            "algorithm=fedavg__cut=1__seed=0",
        ]
    )
    fed = runs["algorithm=fedavg__cut=1__seed=0"]
    assert (fed["optimizer"], fed["lr"], fed["momentum"]) == ("sgd", 0.01, 0.5)
    assert runs["algorithm=sfl_v2__cut=2__seed=0"]["batch_size"] == 32
    assert "batch_size" not in runs["algorithm=sfl_v2__cut=1__seed=0"]
    assert runs["algorithm=sfl_v1__cut=1__seed=0"]["optimizer"] == "adam"
    assert "lr" not in runs["algorithm=sfl_v1__cut=1__seed=0"]


@pytest.mark.parametrize(
    "spec, message",
    [
        ("base: {model: mlp\naxes: [", r"invalid YAML at line \d+"),
        ("- just\n- a list\n", "must be a mapping"),
        ({"axes": {"cut": [1]}}, "missing 'base:'"),
        ({"base": BASE}, "missing 'axes:'"),
        ({"base": BASE, "axes": {"cut": []}}, r"axes\.cut is empty"),
        ({"base": BASE, "axes": {}}, "'axes' must be a non-empty mapping"),
        ({"base": BASE, "axes": {"cut": 1}}, r"axes\.cut must be a list.*1"),
        ({"base": BASE, "axes": {"cut": [1, 1]}}, r"axes\.cut lists 1 twice"),
        ({"base": BASE, "axes": {"cut": [1]}, "grid": {}}, "unknown key 'grid'"),
        ({"base": {**BASE, "lrr": 0.1}, "axes": {"cut": [1]}}, "unknown key 'lrr'"),
        ({"base": BASE, "axes": {"algorithm": ["sfl_v1", "nope"]}}, r"run algorithm=nope: .*'nope'"),
        ({"base": BASE, "axes": {"partition": ["iid", "dirichlet:-1"]}}, "dirichlet:-1"),
        ({"base": BASE, "axes": {"lr": [0.1, -1.0]}}, r"lr=-1\.0.*-1\.0"),
        ({"base": {**BASE, "out": "x"}, "axes": {"cut": [1]}}, "'out' is set per run"),
        ({"base": BASE, "axes": {"resume": [True]}}, "'resume' is set per run"),
        ({"base": BASE, "axes": {"cut": [1]}, "exclude": [{"cutt": 1}]}, "'cutt', which is not an axis"),
        ({"base": BASE, "axes": {"cut": [1]}, "exclude": [{"cut": 3}]}, r"exclude\[0\]\.cut = 3"),
        ({"base": BASE, "axes": {"cut": [1]}, "exclude": [{"cut": 1}]}, "removes every grid point"),
        (
            {"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"cut": 1}}]},
            "exactly the keys 'when' and 'set'",
        ),
        (
            {"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"algo": "x"}, "set": {"lr": 1}}]},
            "'algo', which is set in neither",
        ),
        (
            {"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"cut": 1}, "set": {"cut": 2}}]},
            "changes the axis 'cut'",
        ),
        (
            {"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"cut": 1}, "set": {"lrr": 2}}]},
            "unknown key 'lrr'",
        ),
        (
            {"base": {**BASE, "dataset": "fashion_mnist"}, "axes": {"data_dir": ["a:b", "a/b"]}},
            "same run name 'data_dir=a-b'",
        ),
        ({"base": BASE, "axes": {"cut": [1]}, "report": {"target_accuracy": 80}}, "fraction in"),
    ],
)
def test_sweep_validation_errors(tmp_path: Path, spec, message):
    path = write_sweep(tmp_path, spec)
    with pytest.raises(UserError, match=message):
        expand_sweep(path)


def test_missing_sweep_file(tmp_path: Path):
    with pytest.raises(UserError, match="nope.yaml: no such file"):
        expand_sweep(tmp_path / "nope.yaml")


def test_sweep_validates_every_point_before_running(tmp_path: Path, monkeypatch):
    import splitlab.engine

    calls = []
    monkeypatch.setattr(splitlab.engine, "run", lambda config, **kw: calls.append(config))
    path = write_sweep(tmp_path, {"base": BASE, "axes": {"seed": [0, 1], "algorithm": ["sfl_v1", "nope"]}})
    with pytest.raises(UserError, match="nope"):
        run_sweep(path, out=tmp_path / "out", progress=False)
    assert calls == [] and not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="--jobs"):
        run_sweep(path, out=tmp_path / "out", jobs=0)


def test_failing_run_is_recorded_and_others_go_on(tmp_path: Path, monkeypatch):
    """A run that raises does not stop the sweep; it is reported at the end and retried next time."""
    import splitlab.build
    import splitlab.engine

    calls = []

    def fake_run(config, *, resume=False, progress=True):
        calls.append(Path(config["out"]).name)
        if config["cut"] == 2 and not (tmp_path / "fixed").exists():
            raise RuntimeError("simulated crash")
        out = Path(config["out"])
        out.mkdir(parents=True, exist_ok=True)
        summary = {"final_accuracy": 0.5, "total_gib": 0.1}
        (out / "summary.json").write_text(json.dumps(summary))
        return summary

    monkeypatch.setattr(splitlab.engine, "run", fake_run)
    monkeypatch.setattr(splitlab.build, "check", lambda config: None)  # cut=3 would be refused up front
    path = write_sweep(tmp_path, {"base": BASE, "axes": {"cut": [1, 2, 3]}})
    with pytest.raises(SweepFailed) as info:
        run_sweep(path, out=tmp_path / "out", progress=False)
    assert calls == ["cut=1", "cut=2", "cut=3"]
    assert list(info.value.failures) == ["cut=2"] and "1 of 3 runs failed" in str(info.value)
    assert "simulated crash" in (tmp_path / "out" / "cut=2" / "error.txt").read_text()
    assert "cut=2" in json.loads((tmp_path / "out" / "failures.json").read_text())
    assert {r["run"]: r["status"] for r in collect_results(tmp_path / "out")} == {
        "cut=1": "finished",
        "cut=2": "failed",
        "cut=3": "finished",
    }

    (tmp_path / "fixed").touch()
    calls.clear()
    assert run_sweep(path, out=tmp_path / "out", progress=False) == tmp_path / "out"
    assert calls == ["cut=2"]  # finished runs are skipped
    assert not (tmp_path / "out" / "failures.json").exists()
    assert not (tmp_path / "out" / "cut=2" / "error.txt").exists()


def test_sweep_refuses_a_run_dir_made_with_another_config(tmp_path: Path, monkeypatch):
    import splitlab.engine

    calls = []
    monkeypatch.setattr(splitlab.engine, "run", lambda config, **kw: calls.append(config))
    path = write_sweep(tmp_path, {"base": {**BASE, "lr": 0.001}, "axes": {"cut": [1, 2]}})
    stale = tmp_path / "out" / "cut=2"
    stale.mkdir(parents=True)
    (stale / "config.yaml").write_text(yaml.safe_dump({**BASE, "cut": 2, "lr": 0.5, "out": "elsewhere"}))
    with pytest.raises(UserError, match=r"cut=2 .*lr=0\.5.*lr=0\.001"):
        run_sweep(path, out=tmp_path / "out", progress=False)
    assert calls == []


# --------------------------------------------------------------------------- the real engine

TINY = {"base": BASE, "axes": {"algorithm": ["sfl_v1", "sfl_v2"], "cut": [1, 2], "seed": [0, 1]}}
STABLE = (
    "run",
    "status",
    "algorithm",
    "cut",
    "seed",
    "rounds_completed",
    "final_accuracy",
    "best_accuracy",
    "best_round",
    "final_loss",
    "final_f1",
    "final_mcc",
    "total_bytes",
    "rounds_to_target",
    "gib_to_target",
)


def numbers(sweep_dir: Path) -> dict[str, dict]:
    """results.csv without the columns that legitimately differ (wall time)."""
    return {r["run"]: {k: r[k] for k in STABLE} for r in read_csv(sweep_dir / "results.csv")}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny sweep run once, end to end, with jobs=1."""
    tmp = tmp_path_factory.mktemp("tiny")
    path = write_sweep(tmp, TINY)
    sweep_dir = run_sweep(path, out=tmp / "ref", jobs=1, progress=False)
    write_report(sweep_dir, target_accuracy=0.3)
    return path, sweep_dir


def test_tiny_sweep_end_to_end(reference):
    path, sweep_dir = reference
    names = [n for n, _ in expand_sweep(path, out=sweep_dir)]
    assert len(names) == 8
    for name in names:
        summary = json.loads((sweep_dir / name / "summary.json").read_text())
        assert summary["rounds_completed"] == 2
    rows = read_csv(sweep_dir / "results.csv")
    assert sorted(r["run"] for r in rows) == sorted(names) and {r["status"] for r in rows} == {"finished"}
    md = (sweep_dir / "report.md").read_text()
    _, final = table(md, "Final test accuracy")
    assert set(final) == {"sfl_v1 (cut=1)", "sfl_v1 (cut=2)", "sfl_v2 (cut=1)", "sfl_v2 (cut=2)"}
    for label, cells in final.items():
        alg, cut = label.split(" (cut=")
        values = [
            100 * float(r["final_accuracy"]) for r in rows if r["algorithm"] == alg and r["cut"] == cut.rstrip(")")
        ]
        mean, std = mean_std(values)
        assert plain(cells[0]) == f"{mean:.2f} ± {std:.2f}"
    for png in ("accuracy_vs_round", "accuracy_vs_gib", "accuracy_vs_cut", "label_distribution"):
        assert (sweep_dir / "plots" / f"{png}.png").read_bytes()[:8] == PNG_SIGNATURE


def test_sweep_resumes_after_a_kill(reference, tmp_path: Path, monkeypatch):
    """Kill the sweep right after the 2nd run's first checkpoint; running it again skips the
    finished run, resumes the half-finished one from its checkpoint and starts the rest, and
    ends with exactly the numbers of the uninterrupted sweep."""
    import splitlab.checkpoints
    import splitlab.engine

    path, ref_dir = reference
    out = tmp_path / "resumed"
    checkpointer = splitlab.checkpoints.Checkpointer
    real_save = checkpointer.maybe_save
    saves: list[str] = []

    def save(self, loop):
        real_save(self, loop)
        self.join()
        saves.append(self.path.parent.name)

    def save_then_die(self, loop):
        save(self, loop)
        if len(saves) == 2:  # run 1 saved round 1 (none after its last); run 2 has just saved round 1
            raise KeyboardInterrupt  # like Ctrl-C / a kill: nothing after this point runs

    monkeypatch.setattr(checkpointer, "maybe_save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, out=out, progress=False)
    first, second = saves
    assert (out / first / "summary.json").exists()
    assert (out / second / CHECKPOINT).exists() and not (out / second / "summary.json").exists()

    saves.clear()
    runs: list[str] = []
    real_run = splitlab.engine.run

    def counting_run(config, **kw):
        runs.append(Path(config["out"]).name)
        return real_run(config, **kw)

    monkeypatch.setattr(checkpointer, "maybe_save", save)
    monkeypatch.setattr(splitlab.engine, "run", counting_run)
    run_sweep(path, out=out, progress=False)
    assert first not in runs and len(runs) == 7  # the finished run is skipped
    assert saves.count(second) == 0  # resumed at round 1 of 2: only round 2 was trained
    assert all(saves.count(n) == 1 for n in runs if n != second)
    write_report(out, target_accuracy=0.3)
    assert numbers(out) == numbers(ref_dir)


def test_parallel_jobs_give_the_same_numbers(reference, tmp_path: Path):
    path, ref_dir = reference
    out = run_sweep(path, out=tmp_path / "par", jobs=2, progress=False)
    write_report(out, target_accuracy=0.3)
    assert numbers(out) == numbers(ref_dir)


def test_parallel_failure_does_not_stop_the_others(tmp_path: Path):
    """lr=1e4 with SGD passes every check but diverges inside the run (NonFiniteLoss)."""
    base = {**BASE, "rounds": 1, "algorithm": "sfl_v2", "optimizer": "sgd"}
    path = write_sweep(tmp_path, {"base": base, "axes": {"lr": [10000.0, 0.01]}})
    with pytest.raises(SweepFailed) as info:
        run_sweep(path, out=tmp_path / "o", jobs=2, progress=False)
    (failed,) = info.value.failures
    (finished,) = [p for p in (tmp_path / "o").iterdir() if (p / "summary.json").exists()]
    assert failed != finished.name and "diverged" in (tmp_path / "o" / failed / "error.txt").read_text()


def test_a_second_sweep_into_the_same_directory_is_refused(tmp_path: Path):
    """The sweep directory is locked for the sweep's duration (each run's directory is too)."""
    from splitlab import rundir

    path, out = write_sweep(tmp_path, TINY), tmp_path / "busy"
    with rundir.locked(out), pytest.raises(UserError, match=r"out '.*busy' is in use by PID \d+ on host"):
        run_sweep(path, out=out, progress=False)
    assert not any(out.iterdir())  # refused before any run started


def test_a_sweep_checks_every_run_before_the_first_starts(tmp_path: Path, capsys):
    """A value only the run itself would refuse (a cut the model lacks, more test samples than the
    dataset has) in the last grid point stops the sweep before any run starts, in one line."""
    from splitlab.cli import main

    for axis, message in (("cut: [1, 9]", "cut"), ("test_subset: [10, 100000]", "test_subset=100000")):
        file = tmp_path / "grid.yaml"
        file.write_text(
            "base: {dataset: digits, model: mlp, clients: 2, rounds: 1, train_subset: 100, device: cpu}\n"
            f"axes: {{{axis}}}\n"
        )
        assert main(["sweep", str(file), "--out", str(tmp_path / "s"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not any((tmp_path / "s").glob("*/metrics.jsonl"))
