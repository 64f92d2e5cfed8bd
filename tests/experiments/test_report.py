"""report.md, results.csv and plots/ (splitlab.experiments.report, tables, plots, runs) on run
directories fabricated with planted numbers."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest
import yaml
from runfiles import PNG_SIGNATURE, fabricate, plain, read_csv, section, table

from splitlab.errors import UserError
from splitlab.experiments import collect_results, write_report
from splitlab.experiments.tables import mean_std

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
    label = {
        ("sfl_v1", "1"): "sfl_v1 (cut=1)",
        ("sfl_v1", "2"): "sfl_v1 (cut=2)",
        ("sfl_v2", "1"): "sfl_v2 (cut=1)",
        ("sfl_v2", "2"): "sfl_v2 (cut=2)",
        ("fedavg", "1"): "fedavg",
    }
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
    acc = {
        ("sfl_v2", "iid"): 0.9,
        ("sfl_v1", "iid"): 0.8,
        ("fedavg", "iid"): 0.7,
        ("sfl_v2", "dirichlet:0.1"): 0.5,
        ("sfl_v1", "dirichlet:0.1"): 0.6,
        ("fedavg", "dirichlet:0.1"): 0.4,
    }
    for (alg, part), a in acc.items():
        fabricate(
            sweep,
            f"{alg}_{part.replace(':', '-')}",
            {"algorithm": alg, "partition": part, "cut": 1},
            [a / 2, a],
            counts=[[5, 0], [0, 5]] if part != "iid" else [[2, 3], [3, 2]],
        )
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
    (nan / "summary.json").write_text(
        (nan / "summary.json").read_text().replace('"final_accuracy": 0.97', '"final_accuracy": NaN')
    )
    torn = fabricate(sweep, "torn_finished", {**c, "seed": 4}, [0.98, 0.99])
    (torn / "metrics.jsonl").write_text((torn / "metrics.jsonl").read_text()[:-30])
    running = fabricate(sweep, "torn_running", {**c, "seed": 5}, [0.2, 0.4], finished=False)
    (running / "metrics.jsonl").write_text((running / "metrics.jsonl").read_text()[:-30])  # tolerated

    md = write_report(sweep).read_text()
    err = capsys.readouterr().err
    for name, what in [
        ("truncated", "summary.json is not valid JSON"),
        ("garbage", "metrics.jsonl line 2"),
        ("nan", "summary.json is not valid JSON"),
        ("torn_finished", "metrics.jsonl line 2"),
    ]:
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
            for tb, b in boxes[i + 1 :]:
                if a.overlaps(b):
                    clashes.append((ta, tb))
    return clashes


def test_plots_share_y_mark_identical_curves_readable_log_ticks_and_honest_titles(tmp_path: Path):
    from splitlab.experiments.analysis import Analysis
    from splitlab.experiments.plots import curves_figure
    from splitlab.units import row_gib

    sweep = tmp_path / "sweep"
    accs = [0.2 + 0.05 * r for r in range(12)]
    for part, shift in (("iid", 0.0), ("dirichlet:0.1", -0.15)):
        shifted = [a + shift for a in accs]
        tag = part.replace(":", "")
        fabricate(
            sweep, f"fedavg_{tag}", {"algorithm": "fedavg", "cut": 1, "partition": part}, shifted, gib_per_round=0.45
        )
        fabricate(
            sweep, f"sfl_v1_{tag}", {"algorithm": "sfl_v1", "cut": 1, "partition": part}, shifted, gib_per_round=0.4
        )
        fabricate(
            sweep,
            f"sfl_v2_{tag}",
            {"algorithm": "sfl_v2", "cut": 1, "partition": part},
            [a + 0.01 for a in shifted],
            gib_per_round=0.05,
        )
    an = Analysis(sweep, None)
    fig = curves_figure(an, lambda m: m.get("round"), "round", "Test accuracy vs round")
    assert len(fig.axes) == 2 and fig.axes[0].get_shared_y_axes().joined(fig.axes[0], fig.axes[1])
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "sfl_v1 (= fedavg, identical)" in labels and "sfl_v2" in labels
    assert "mean ± std" not in fig._suptitle.get_text()  # one seed per curve

    log_fig = curves_figure(an, row_gib, "communication (GiB)", "Test accuracy vs GiB", logx=True)
    assert not any("identical" in lab for lab in log_fig.axes[0].get_legend_handles_labels()[1])  # other GiB
    assert log_fig.axes[0].get_xscale() == "log"
    assert _label_boxes_overlap(log_fig) == []

    fabricate(
        sweep,
        "sfl_v2_iid_seed1",
        {"algorithm": "sfl_v2", "cut": 1, "partition": "iid", "seed": 1},
        accs,
        gib_per_round=0.05,
    )
    assert (
        "mean ± std over seeds"
        in curves_figure(Analysis(sweep, None), lambda m: m.get("round"), "round", "t")._suptitle.get_text()
    )


def test_report_of_one_run_directory_writes_its_tables_and_curves_with_whole_round_ticks(tmp_path: Path):
    from splitlab.experiments.analysis import Analysis
    from splitlab.experiments.plots import curves_figure

    run = fabricate(tmp_path, "one", {"algorithm": "sfl_v2", "cut": 1}, [0.3, 0.5, 0.6])
    report = write_report(run)
    assert report == run / "report.md"
    assert [(row["run"], float(row["final_accuracy"])) for row in read_csv(run / "results.csv")] == [("one", 0.6)]
    for name in ("accuracy_vs_round.png", "accuracy_vs_gib.png"):
        assert (run / "plots" / name).read_bytes().startswith(PNG_SIGNATURE)
    fig = curves_figure(Analysis(run, None), lambda m: m.get("round"), "round", "t", integer_x=True)
    ticks = [t for t in fig.axes[0].get_xticks() if 1 <= t <= 3]
    assert ticks == [1, 2, 3]


def test_runs_stuck_at_chance_are_flagged(tmp_path: Path):
    sweep = tmp_path / "sweep"
    fabricate(sweep, "learned", {"algorithm": "fedavg", "cut": 1, "seed": 0}, [0.5, 0.9])  # 3 classes: chance 33.33%
    fabricate(sweep, "stuck", {"algorithm": "fedavg", "cut": 1, "seed": 1}, [0.34, 0.35])
    md = write_report(sweep).read_text()
    _, rows = table(md, "Runs at chance level")
    assert rows == {"stuck": ["35.00", "33.33"]}


def test_language_runs_get_test_loss_and_perplexity_against_rounds_and_communication(tmp_path: Path):
    """FSL-SAGE's Fig. 5 axes: masked test loss (and perplexity) against bytes, for runs that log perplexity."""
    import json
    import math

    from splitlab.experiments.analysis import Analysis
    from splitlab.experiments.plots import LOSS, PERPLEXITY, curves_figure
    from splitlab.units import row_gib

    sweep = tmp_path / "lm"
    losses = {"fsl_sage": [3.0, 2.5, 2.2], "sfl_v1": [3.1, 2.9, 2.8]}
    for algorithm, planted in losses.items():
        run = fabricate(
            sweep,
            algorithm,
            {"algorithm": algorithm, "cut": 1, "dataset": "shakespeare_lm", "model": "gpt"},
            [0.2, 0.3, 0.35],  # token accuracy: what the accuracy plots show
            gib_per_round=0.1 if algorithm == "fsl_sage" else 0.4,
        )
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for row, loss in zip(rows, planted, strict=True):
            row.update(test_loss=loss, test_perplexity=math.exp(loss))
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    md = write_report(sweep).read_text()
    for name in ("loss_vs_round", "loss_vs_gib", "perplexity_vs_round", "perplexity_vs_gib"):
        assert (sweep / "plots" / f"{name}.png").read_bytes()[:8] == PNG_SIGNATURE, name
        assert f"(plots/{name}.png)" in md

    an = Analysis(sweep, None)
    fig = curves_figure(an, row_gib, "communication (GiB)", "Test loss vs GiB", logx=True, metric=LOSS)
    ax = fig.axes[0]
    assert ax.get_ylabel() == "test loss (masked cross-entropy)" and ax.get_xscale() == "log"
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
    assert drawn["fsl_sage"][0] == pytest.approx([0.1, 0.2, 0.3]) and drawn["fsl_sage"][1] == losses["fsl_sage"]
    assert drawn["sfl_v1"][1] == losses["sfl_v1"]  # the loss, not the accuracy planted beside it
    perplexity = curves_figure(an, row_gib, "GiB", "t", logx=True, metric=PERPLEXITY).axes[0]
    assert perplexity.get_yscale() == "log"
    assert list(perplexity.lines[0].get_ydata()) == [math.exp(v) for v in losses["fsl_sage"]]


def test_image_runs_get_no_loss_plots(planted: Path):
    write_report(planted, target_accuracy=0.75)
    assert not (planted / "plots" / "loss_vs_gib.png").exists()


def test_runs_with_eval_generate_get_bleu_and_rouge_l_tables(tmp_path: Path, planted: Path):
    """Mean ± std over seeds of the planted BLEU and ROUGE-L, the higher bold; none without them."""
    import json

    sweep = tmp_path / "e2e"
    planted_scores = {"fedavg": [(40.0, 0.6), (44.0, 0.64)], "fsl_sage": [(20.0, 0.5), (20.0, 0.5)]}
    for algorithm, scores in planted_scores.items():
        for seed, (bleu, rouge) in enumerate(scores):
            run = fabricate(sweep, f"{algorithm}_{seed}", {"algorithm": algorithm, "seed": seed, "cut": 1}, [0.2, 0.3])
            summary = json.loads((run / "summary.json").read_text())
            (run / "summary.json").write_text(json.dumps({**summary, "bleu": bleu, "rouge_l": rouge}))
    md = write_report(sweep).read_text()
    rows = [line for line in section(md, "Generation: BLEU and ROUGE-L").splitlines() if line.startswith("| f")]
    assert rows == [
        f"| fedavg | **42.00 ± {statistics.stdev([40.0, 44.0]):.2f}** |",
        "| fsl_sage | 20.00 ± 0.00 |",
        f"| fedavg | **0.620 ± {statistics.stdev([0.6, 0.64]):.3f}** |",
        "| fsl_sage | 0.500 ± 0.000 |",
    ]
    assert [row["bleu"] for row in read_csv(sweep / "results.csv")] == ["40.0", "44.0", "20.0", "20.0"]
    assert "BLEU" not in write_report(planted).read_text()
