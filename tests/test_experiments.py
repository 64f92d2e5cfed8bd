"""Sweeps, results.csv, report.md and plots (splitlab.experiments).

The report tests run on run directories fabricated here with planted numbers; the sweep tests
run the real engine on a tiny grid (2 algorithms x 2 cuts x 2 seeds on digits).
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path

import pytest
import yaml

from splitlab.errors import UserError
from splitlab.experiments import SweepFailed, collect_results, expand_sweep, run_name, run_sweep, write_report
from splitlab.experiments.report import mean_std

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- fabricated runs


def fabricate(sweep: Path, name: str, config: dict, accs: list[float], *, gib_per_round: float = 0.5,
              finished: bool = True, error: str | None = None, counts=None) -> Path:
    """A run directory as the engine writes it, with planted per-round accuracies."""
    run = sweep / name
    run.mkdir(parents=True)
    cfg = {"dataset": "digits", "model": "mlp", "clients": 2, "rounds": len(accs), "partition": "iid",
           "seed": 0, **config, "out": str(run)}
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    rows = []
    for r, acc in enumerate(accs, 1):
        nbytes = int(round(gib_per_round * r * 2**30))
        rows.append({"round": r, "test_accuracy": acc, "test_loss": 1 - acc, "test_f1": acc / 2,
                     "test_mcc": acc / 3, "train_loss": 1.5 - acc, "comm_bytes": nbytes,
                     "comm_gib": nbytes / 2**30,
                     "comm_bytes_by_kind": {"smashed": nbytes // 2, "cut_grad": nbytes - nbytes // 2},
                     "wall_seconds": float(r)})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    counts = counts or [[3, 1, 0], [0, 2, 4]]
    (run / "partition.json").write_text(json.dumps(
        {"num_clients": len(counts), "num_classes": len(counts[0]), "counts": counts,
         "sizes": [sum(c) for c in counts]}))
    if error is not None:
        (run / "error.txt").write_text(error)
    elif finished:
        best = max(range(len(accs)), key=lambda i: (accs[i], -i))
        last = rows[-1]
        summary = {**{k: cfg[k] for k in ("algorithm", "dataset", "model", "cut", "seed", "partition", "clients")},
                   "rounds_completed": len(accs), "final_accuracy": accs[-1], "best_accuracy": accs[best],
                   "best_round": best + 1, "final_loss": 1 - accs[-1], "final_f1": accs[-1] / 2,
                   "final_mcc": accs[-1] / 3, "total_bytes": last["comm_bytes"], "total_gib": last["comm_gib"],
                   "comm_bytes_by_kind": last["comm_bytes_by_kind"], "wall_seconds": float(len(accs)),
                   "stopped_by": "rounds"}
        (run / "summary.json").write_text(json.dumps(summary))
    else:
        (run / "checkpoint.pt").write_bytes(b"not a real checkpoint")
    return run


def section(markdown: str, title_start: str) -> str:
    """The text of the `## <title_start>...` section."""
    parts = re.split(r"^## ", markdown, flags=re.M)
    for part in parts:
        if part.startswith(title_start):
            return part
    raise AssertionError(f"no section {title_start!r} in report:\n{markdown}")


def table(markdown: str, title_start: str) -> tuple[list[str], dict[str, list[str]]]:
    """(header, {row label: [cells]}) of the first table in a section."""
    lines = [ln for ln in section(markdown, title_start).splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return header, rows


def plain(cell: str) -> str:
    return cell.replace("**", "").replace("<u>", "").replace("</u>", "")


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


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


# --------------------------------------------------------------------------- report on planted numbers


def test_report_planted_mean_std_marks_and_targets(planted: Path):
    report = write_report(planted, target_accuracy=0.75)
    assert report == planted / "report.md"
    md = report.read_text()

    header, final = table(md, "Final test accuracy")
    assert header[0] == "method" and len(header) == 2
    assert final["sfl_v1 (cut=1)"] == ["60.00 ± 14.14"]  # 0.5 / 0.7, sample std
    assert final["sfl_v1 (cut=2)"] == ["80.00 ± 0.00"]
    assert final["sfl_v2 (cut=1)"] == ["**92.50 ± 3.54**"]  # best: bold
    assert final["sfl_v2 (cut=2)"] == ["<u>85.00 (n=1)</u>"]  # single seed: no ±; second: underlined
    assert final["fedavg"] == ["41.00 ± 1.41"]  # one cut only: no "(cut=1)" in its label
    # without a sweep file, rows are sorted by value
    assert list(final) == ["fedavg", "sfl_v1 (cut=1)", "sfl_v1 (cut=2)", "sfl_v2 (cut=1)", "sfl_v2 (cut=2)"]

    _, best = table(md, "Best test accuracy")
    assert plain(best["sfl_v1 (cut=1)"][0]) == "63.00 ± 18.38"  # best rounds: 0.5 and 0.76

    _, gib = table(md, "Communication to reach 75%")
    # lower is better; only 2 different values among fully-reached cells: bold, no underline
    assert gib["sfl_v2 (cut=1)"] == ["**512.0 ± 0.0 MiB**"]  # round 1 x 0.5 GiB, both seeds
    assert gib["sfl_v2 (cut=2)"] == ["**512.0 MiB (n=1)**"]
    assert gib["sfl_v1 (cut=2)"] == ["768.0 ± 362.0 MiB"]  # round 2 x 0.5 and x 0.25 GiB
    assert gib["sfl_v1 (cut=1)"] == ["512.0 MiB (1/2 reached)"]  # partly reached: not ranked
    assert gib["fedavg"] == ["not reached"]
    _, rounds = table(md, "Rounds to reach 75%")
    assert plain(rounds["sfl_v1 (cut=2)"][0]) == "2.0 ± 0.0"
    assert plain(rounds["sfl_v2 (cut=1)"][0]) == "1.0 ± 0.0"
    assert rounds["fedavg"] == ["not reached"]
    assert "ddof = 1" in md and "sample standard deviation" in md

    unfinished = section(md, "Runs not finished")
    assert re.search(r"\| b2s1 \| incomplete \| 1 \|", unfinished)
    assert re.search(r"\| b2s2 \| failed \| 0 \| RuntimeError: boom in round 3 \|", unfinished)


def test_results_csv_one_row_per_run_with_planted_numbers(planted: Path):
    write_report(planted, target_accuracy=0.75)
    rows = {r["run"]: r for r in read_csv(planted / "results.csv")}
    assert sorted(rows) == sorted(p.name for p in planted.iterdir() if p.is_dir() and p.name != "plots")
    assert rows["a1s0"]["status"] == "finished" and rows["b2s1"]["status"] == "incomplete"
    assert rows["b2s2"]["status"] == "failed"
    assert float(rows["a1s0"]["final_accuracy"]) == 0.5 and float(rows["a1s1"]["final_accuracy"]) == 0.7
    assert float(rows["a1s1"]["best_accuracy"]) == 0.76 and rows["a1s1"]["best_round"] == "1"
    assert rows["a1s0"]["algorithm"] == "sfl_v1" and rows["a1s0"]["cut"] == "1" and rows["a1s1"]["seed"] == "1"
    assert rows["a1s0"]["rounds_to_target"] == "" and rows["a1s0"]["gib_to_target"] == ""  # not reached
    assert rows["a1s1"]["rounds_to_target"] == "1" and float(rows["a1s1"]["gib_to_target"]) == 0.5
    assert float(rows["a2s1"]["gib_to_target"]) == 0.5 and float(rows["a2s0"]["gib_to_target"]) == 1.0
    assert float(rows["a2s0"]["total_gib"]) == 1.0 and float(rows["a2s0"]["bytes_smashed"]) == 2**29
    assert rows["b2s1"]["final_accuracy"] == "" and rows["b2s1"]["rounds_completed"] == "1"
    assert collect_results(planted, 0.75)[0]["run"] == "a1s0"


def test_report_tables_match_results_csv(planted: Path):
    md = write_report(planted, target_accuracy=0.75).read_text()
    rows = [r for r in read_csv(planted / "results.csv") if r["status"] == "finished"]
    _, final = table(md, "Final test accuracy")
    groups: dict[tuple, list[float]] = {}
    for r in rows:
        groups.setdefault((r["algorithm"], r["cut"]), []).append(100 * float(r["final_accuracy"]))
    label = {("sfl_v1", "1"): "sfl_v1 (cut=1)", ("sfl_v1", "2"): "sfl_v1 (cut=2)",
             ("sfl_v2", "1"): "sfl_v2 (cut=1)", ("sfl_v2", "2"): "sfl_v2 (cut=2)", ("fedavg", "1"): "fedavg"}
    for key, values in groups.items():
        cell = plain(final[label[key]][0])
        mean = float(cell.split()[0])
        assert mean == pytest.approx(statistics.fmean(values), abs=0.005)
        if len(values) > 1:
            assert float(cell.split("±")[1]) == pytest.approx(statistics.stdev(values), abs=0.005)
        else:
            assert "±" not in cell


def test_plots_are_valid_pngs(planted: Path):
    import matplotlib.image

    write_report(planted, target_accuracy=0.75)
    names = ["accuracy_vs_round", "accuracy_vs_gib", "accuracy_vs_cut", "label_distribution"]
    md = (planted / "report.md").read_text()
    for name in names:
        png = planted / "plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_SIGNATURE, name
        image = matplotlib.image.imread(png)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
        assert image.std() > 0.01  # not blank
        assert f"(plots/{name}.png)" in md


def test_report_columns_axis_order_and_marks_per_column(tmp_path: Path):
    """With a sweep snapshot: partitions become columns, rows follow the axis order, and bold /
    underline are chosen per column."""
    sweep = tmp_path / "s"
    sweep.mkdir()
    axes = {"algorithm": ["sfl_v2", "sfl_v1", "fedavg"], "partition": ["iid", "dirichlet:0.1"], "seed": [0]}
    (sweep / "sweep.yaml").write_text(yaml.safe_dump({"source": "exp/cut.yaml", "axes": axes, "runs": {}}))
    acc = {("sfl_v2", "iid"): 0.9, ("sfl_v1", "iid"): 0.8, ("fedavg", "iid"): 0.7,
           ("sfl_v2", "dirichlet:0.1"): 0.5, ("sfl_v1", "dirichlet:0.1"): 0.6, ("fedavg", "dirichlet:0.1"): 0.4}
    for (alg, part), a in acc.items():
        fabricate(sweep, f"{alg}_{part.replace(':', '-')}", {"algorithm": alg, "partition": part, "cut": 1},
                  [a / 2, a], counts=[[5, 0], [0, 5]] if part != "iid" else [[2, 3], [3, 2]])
    md = write_report(sweep).read_text()
    assert md.startswith("# Sweep report: cut")
    header, final = table(md, "Final test accuracy")
    assert header == ["method", "iid", "dirichlet:0.1"]
    assert list(final) == ["sfl_v2", "sfl_v1", "fedavg"]
    assert final["sfl_v2"] == ["**90.00**", "<u>50.00</u>"]
    assert final["sfl_v1"] == ["<u>80.00</u>", "**60.00**"]
    assert final["fedavg"] == ["70.00", "40.00"]
    # default target: 80% of the best accuracy reached (0.9), rounded down to a whole percent
    assert "## Communication to reach 72% test accuracy" in md
    assert {r["target_accuracy"] for r in read_csv(sweep / "results.csv")} == {"0.72"}


def test_report_user_errors(tmp_path: Path, planted: Path):
    with pytest.raises(UserError, match="not found"):
        write_report(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="holds no runs"):
        write_report(tmp_path / "empty")
    with pytest.raises(UserError, match=r"target.*fraction in \(0, 1\].*got 75"):
        write_report(planted, target_accuracy=75)


def test_mean_std_is_sample_std():
    assert mean_std([50.0, 70.0]) == (60.0, pytest.approx(14.142135623730951))
    assert mean_std([1.0]) == (1.0, None)


# --------------------------------------------------------------------------- sweep files

BASE = {"dataset": "digits", "model": "mlp", "clients": 3, "rounds": 2, "train_subset": 300, "device": "cpu"}


def write_sweep(tmp_path: Path, spec, name: str = "tiny.yaml") -> Path:
    path = tmp_path / name
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False))
    return path


def test_expand_grid_order_names_and_out(tmp_path: Path):
    path = write_sweep(tmp_path, {"base": BASE, "axes": {"algorithm": ["sfl_v1", "sfl_v2"], "cut": [1, 2],
                                                         "partition": ["iid", "dirichlet:0.1"]}})
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
    assert run_name({"partition": "dirichlet:0.1", "lr": 0.001, "x": True, "d": "a/b c"}) == \
        "partition=dirichlet-0.1__lr=0.001__x=true__d=a-b-c"
    long = run_name({"data_dir": "x" * 300})
    assert len(long) <= 200 and long == run_name({"data_dir": "x" * 300})
    assert long != run_name({"data_dir": "x" * 299 + "y"})
    for name in (long, run_name({"p": "../..", "q": "*?<>|\"\\"})):
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
    assert sorted(runs) == sorted([
        "algorithm=sfl_v1__cut=1__seed=0", "algorithm=sfl_v1__cut=2__seed=0", "algorithm=sfl_v2__cut=1__seed=0",
        "algorithm=sfl_v2__cut=2__seed=0", "algorithm=fedavg__cut=1__seed=0"])
    fed = runs["algorithm=fedavg__cut=1__seed=0"]
    assert (fed["optimizer"], fed["lr"], fed["momentum"]) == ("sgd", 0.01, 0.5)
    assert runs["algorithm=sfl_v2__cut=2__seed=0"]["batch_size"] == 32
    assert "batch_size" not in runs["algorithm=sfl_v2__cut=1__seed=0"]
    assert runs["algorithm=sfl_v1__cut=1__seed=0"]["optimizer"] == "adam"
    assert "lr" not in runs["algorithm=sfl_v1__cut=1__seed=0"]


@pytest.mark.parametrize("spec, message", [
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
    ({"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"cut": 1}}]}, "exactly the keys 'when' and 'set'"),
    ({"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"algo": "x"}, "set": {"lr": 1}}]},
     "'algo', which is set in neither"),
    ({"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"cut": 1}, "set": {"cut": 2}}]},
     "changes the axis 'cut'"),
    ({"base": BASE, "axes": {"cut": [1]}, "overrides": [{"when": {"cut": 1}, "set": {"lrr": 2}}]},
     "unknown key 'lrr'"),
    ({"base": BASE, "axes": {"data_dir": ["a:b", "a/b"]}}, "same run name 'data_dir=a-b'"),
    ({"base": BASE, "axes": {"cut": [1]}, "report": {"target_accuracy": 80}}, "fraction in"),
])
def test_sweep_validation_errors(tmp_path: Path, spec, message):
    path = write_sweep(tmp_path, spec)
    with pytest.raises(UserError, match=message):
        expand_sweep(path)


def test_missing_sweep_file(tmp_path: Path):
    with pytest.raises(UserError, match="nope.yaml not found"):
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
    path = write_sweep(tmp_path, {"base": BASE, "axes": {"cut": [1, 2, 3]}})
    with pytest.raises(SweepFailed) as info:
        run_sweep(path, out=tmp_path / "out", progress=False)
    assert calls == ["cut=1", "cut=2", "cut=3"]
    assert list(info.value.failures) == ["cut=2"] and "1 of 3 runs failed" in str(info.value)
    assert "simulated crash" in (tmp_path / "out" / "cut=2" / "error.txt").read_text()
    assert "cut=2" in json.loads((tmp_path / "out" / "failures.json").read_text())
    assert {r["run"]: r["status"] for r in collect_results(tmp_path / "out")} == \
        {"cut=1": "finished", "cut=2": "failed", "cut=3": "finished"}

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
STABLE = ("run", "status", "algorithm", "cut", "seed", "rounds_completed", "final_accuracy", "best_accuracy",
          "best_round", "final_loss", "final_f1", "final_mcc", "total_bytes", "rounds_to_target", "gib_to_target")


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
        values = [100 * float(r["final_accuracy"]) for r in rows
                  if r["algorithm"] == alg and r["cut"] == cut.rstrip(")")]
        mean, std = mean_std(values)
        assert plain(cells[0]) == f"{mean:.2f} ± {std:.2f}"
    for png in ("accuracy_vs_round", "accuracy_vs_gib", "accuracy_vs_cut", "label_distribution"):
        assert (sweep_dir / "plots" / f"{png}.png").read_bytes()[:8] == PNG_SIGNATURE


def test_sweep_resumes_after_a_kill(reference, tmp_path: Path, monkeypatch):
    """Kill the sweep right after the 2nd run's first checkpoint; running it again skips the
    finished run, resumes the half-finished one from its checkpoint and starts the rest, and
    ends with exactly the numbers of the uninterrupted sweep."""
    import splitlab.engine

    path, ref_dir = reference
    out = tmp_path / "resumed"
    real_save = splitlab.engine.save_torch
    saves: list[str] = []

    def save_then_die(p, obj):
        real_save(p, obj)
        saves.append(Path(p).parent.name)
        if len(saves) == 3:  # run 1 saved rounds 1 and 2; run 2 has just saved round 1
            raise KeyboardInterrupt  # like Ctrl-C / a kill: nothing after this point runs

    monkeypatch.setattr(splitlab.engine, "save_torch", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, out=out, progress=False)
    first, second = saves[0], saves[2]
    assert (out / first / "summary.json").exists()
    assert (out / second / "checkpoint.pt").exists() and not (out / second / "summary.json").exists()

    saves.clear()
    runs: list[str] = []
    real_run = splitlab.engine.run

    def counting_run(config, **kw):
        runs.append(Path(config["out"]).name)
        return real_run(config, **kw)

    monkeypatch.setattr(splitlab.engine, "save_torch", lambda p, obj: (saves.append(Path(p).parent.name),
                                                                         real_save(p, obj)))
    monkeypatch.setattr(splitlab.engine, "run", counting_run)
    run_sweep(path, out=out, progress=False)
    assert first not in runs and len(runs) == 7  # the finished run is skipped
    assert saves.count(second) == 1  # resumed at round 1 of 2: only round 2 was trained
    assert all(saves.count(n) == 2 for n in runs if n != second)
    write_report(out, target_accuracy=0.3)
    assert numbers(out) == numbers(ref_dir)


def test_parallel_jobs_give_the_same_numbers(reference, tmp_path: Path):
    path, ref_dir = reference
    out = run_sweep(path, out=tmp_path / "par", jobs=2, progress=False)
    write_report(out, target_accuracy=0.3)
    assert numbers(out) == numbers(ref_dir)


def test_parallel_failure_does_not_stop_the_others(tmp_path: Path):
    """cut=9 passes config validation but fails inside the run (the MLP has cuts 1..2)."""
    path = write_sweep(tmp_path, {"base": {**BASE, "rounds": 1, "algorithm": "sfl_v2"}, "axes": {"cut": [9, 1]}})
    with pytest.raises(SweepFailed) as info:
        run_sweep(path, out=tmp_path / "o", jobs=2, progress=False)
    assert list(info.value.failures) == ["cut=9"]
    assert (tmp_path / "o" / "cut=1" / "summary.json").exists()
    assert "cut" in (tmp_path / "o" / "cut=9" / "error.txt").read_text()


def test_report_warns_about_unreadable_files_and_prints_no_numbers_from_them(tmp_path: Path, capsys):
    sweep = tmp_path / "sweep"
    c = {"algorithm": "sfl_v1", "cut": 1}
    fabricate(sweep, "good", {**c, "seed": 0}, [0.3, 0.5])
    truncated = fabricate(sweep, "truncated", {**c, "seed": 1}, [0.91, 0.92])
    (truncated / "summary.json").write_text((truncated / "summary.json").read_text()[:40])
    garbage = fabricate(sweep, "garbage", {**c, "seed": 2}, [0.93, 0.94, 0.95])
    lines = (garbage / "metrics.jsonl").read_text().splitlines()
    (garbage / "metrics.jsonl").write_text("\n".join([lines[0], "\x00\x17garbage", *lines[1:]]) + "\n")
    nan = fabricate(sweep, "nan", {**c, "seed": 3}, [0.96, 0.97])
    (nan / "summary.json").write_text((nan / "summary.json").read_text().replace('"final_accuracy": 0.97',
                                                                                    '"final_accuracy": NaN'))
    torn = fabricate(sweep, "torn_finished", {**c, "seed": 4}, [0.98, 0.99])
    (torn / "metrics.jsonl").write_text((torn / "metrics.jsonl").read_text()[:-30])
    running = fabricate(sweep, "torn_running", {**c, "seed": 5}, [0.2, 0.4], finished=False)
    (running / "metrics.jsonl").write_text((running / "metrics.jsonl").read_text()[:-30])  # tolerated

    md = write_report(sweep).read_text()
    err = capsys.readouterr().err
    for name, what in [("truncated", "summary.json is not valid JSON"), ("garbage", "metrics.jsonl line 2"),
                       ("nan", "summary.json is not valid JSON"), ("torn_finished", "metrics.jsonl line 2")]:
        assert re.search(rf"warning: \S*{name}: {what}.*left out", err), err
    assert "torn_running" not in err
    _, final = table(md, "Final test accuracy")
    assert final == {"all runs": ["50.00"]}  # only the good run
    for value in ("91", "93", "95", "96", "97", "98", "99"):
        assert f"{value}.00" not in md
    status = {r["run"]: r for r in collect_results(sweep)}
    assert status["truncated"]["status"] == "unreadable" and status["truncated"]["final_accuracy"] is None
    assert status["torn_running"]["status"] == "incomplete" and status["torn_running"]["rounds_completed"] == 1
    assert "| garbage | unreadable | 0 | metrics.jsonl line 2 is not valid JSON" in md


def _label_boxes_overlap(fig) -> list[tuple[str, str]]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    clashes = []
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels(which="both") if t.get_visible() and t.get_text()]
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in labels]
        boxes = [(text, b) for text, b in boxes if ax.bbox.x0 - 5 <= (b.x0 + b.x1) / 2 <= ax.bbox.x1 + 5]
        for i, (ta, a) in enumerate(boxes):
            for tb, b in boxes[i + 1:]:
                if a.overlaps(b):
                    clashes.append((ta, tb))
    return clashes


def test_plots_share_y_mark_identical_curves_readable_log_ticks_and_honest_titles(tmp_path: Path):
    from splitlab.comm import row_gib
    from splitlab.experiments.report import _Analysis, _curves_figure

    sweep = tmp_path / "sweep"
    accs = [0.2 + 0.05 * r for r in range(12)]
    for part, shift in (("iid", 0.0), ("dirichlet:0.1", -0.15)):
        shifted = [a + shift for a in accs]
        tag = part.replace(":", "")
        fabricate(sweep, f"fedavg_{tag}", {"algorithm": "fedavg", "cut": 1, "partition": part}, shifted,
                  gib_per_round=0.45)
        fabricate(sweep, f"sfl_v1_{tag}", {"algorithm": "sfl_v1", "cut": 1, "partition": part}, shifted,
                  gib_per_round=0.4)
        fabricate(sweep, f"sfl_v2_{tag}", {"algorithm": "sfl_v2", "cut": 1, "partition": part},
                  [a + 0.01 for a in shifted], gib_per_round=0.05)
    an = _Analysis(sweep, None)
    fig = _curves_figure(an, lambda m: m.get("round"), "round", "Test accuracy vs round")
    assert len(fig.axes) == 2 and fig.axes[0].get_shared_y_axes().joined(fig.axes[0], fig.axes[1])
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "sfl_v1 (= fedavg, identical)" in labels and "sfl_v2" in labels
    assert "mean ± std" not in fig._suptitle.get_text()  # one seed per curve

    log_fig = _curves_figure(an, row_gib, "communication (GiB)", "Test accuracy vs GiB", logx=True)
    assert not any("identical" in lab for lab in log_fig.axes[0].get_legend_handles_labels()[1])  # other GiB
    assert log_fig.axes[0].get_xscale() == "log"
    assert _label_boxes_overlap(log_fig) == []

    fabricate(sweep, "sfl_v2_iid_seed1", {"algorithm": "sfl_v2", "cut": 1, "partition": "iid", "seed": 1},
              accs, gib_per_round=0.05)
    assert "mean ± std over seeds" in _curves_figure(_Analysis(sweep, None), lambda m: m.get("round"), "round",
                                                     "t")._suptitle.get_text()
