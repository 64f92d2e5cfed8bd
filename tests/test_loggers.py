"""logger=tensorboard: a clear error when the package is missing, the right scalars when present."""

from __future__ import annotations

import pytest

import splitlab.loggers as loggers
from helpers import crash_before_round, quick
from splitlab.engine import run
from splitlab.errors import UserError


def test_missing_tensorboard_is_a_user_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(loggers, "installed", lambda package: False)
    with pytest.raises(UserError, match="logger=tensorboard needs the tensorboard package"):
        run(quick(algorithm="sfl_v2", logger="tensorboard", out=str(tmp_path / "r")), progress=False)
    assert not (tmp_path / "r").exists()


class RecordingWriter:
    """Stands in for torch's SummaryWriter, which needs the tensorboard package."""

    def __init__(self):
        self.scalars, self.closed = [], False

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_every_evaluated_round_is_logged(tmp_path, monkeypatch):
    writer = RecordingWriter()
    monkeypatch.setattr(loggers, "installed", lambda package: True)
    monkeypatch.setattr(loggers.TensorBoardLogger, "__init__", lambda self, out: setattr(self, "writer", writer))
    run(quick(algorithm="sfl_v2", rounds=2, logger="tensorboard", out=str(tmp_path)), progress=False)
    assert writer.closed
    steps = {(key, step) for key, _, step in writer.scalars}
    for key in ("test_accuracy", "test_loss", "comm_gib", "comm_gib/smashed"):
        assert {(key, 1), (key, 2)} <= steps


def test_csv_writes_one_row_per_evaluated_round_equal_to_metrics_jsonl(tmp_path):
    import csv
    import json

    run(quick(algorithm="sfl_v2", rounds=5, eval_every=2, logger="csv", out=str(tmp_path)), progress=False)
    with open(tmp_path / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    expected = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [int(row["round"]) for row in rows] == [2, 4, 5]
    for row, full in zip(rows, expected):
        assert float(row["test_accuracy"]) == full["test_accuracy"]  # repr round-trips a float exactly
        assert int(row["comm_bytes"]) == full["comm_bytes"]
        assert {k: int(row[f"comm_bytes_by_kind/{k}"]) for k in full["comm_bytes_by_kind"]} == full[
            "comm_bytes_by_kind"
        ]


def test_a_resumed_run_writes_the_csv_of_an_uninterrupted_one(tmp_path, monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    config = quick(algorithm="fedavg", rounds=3, logger="csv", checkpoint_every=0)
    run({**config, "out": str(straight)}, progress=False)
    crash_before_round(2, {**config, "out": str(resumed)}, monkeypatch)
    assert (resumed / "metrics.csv").read_text().count("\n") == 3  # the header and rounds 1 and 2
    run({**config, "out": str(resumed), "resume": True}, progress=False)

    def without_time(path):
        lines = [line.split(",") for line in (path / "metrics.csv").read_text().splitlines()]
        keep = [i for i, column in enumerate(lines[0]) if "seconds" not in column]
        return [[line[i] for i in keep] for line in lines]

    assert without_time(resumed) == without_time(straight)


@pytest.mark.parametrize("name", ["mlflow", "wandb"])
def test_a_tracker_whose_package_is_missing_is_one_line_naming_the_extra(tmp_path, monkeypatch, name):
    monkeypatch.setattr(loggers, "installed", lambda package: False)
    with pytest.raises(
        UserError, match=rf"logger={name} needs the {name} package \(pip install 'splitlab\[{name}\]'\)"
    ):
        run(quick(algorithm="fedavg", logger=name, out=str(tmp_path / "r")), progress=False)
    assert not (tmp_path / "r").exists()


def test_callbacks_of_ones_own_see_every_round_and_change_nothing(tmp_path):
    from splitlab.callbacks import Callback

    class Seen(Callback):
        def __init__(self):
            self.calls = []

        def on_run_start(self, state):
            self.calls.append(("start", state["round"]))

        def on_round_trained(self, state):
            self.calls.append(("trained", state["round"]))
            return "enough" if state["round"] == 3 else None

        def on_round_end(self, state, row):
            self.calls.append(("end", state["round"], row is not None))

        def on_run_end(self, state):
            self.calls.append(("stop", state["round"]))

    seen = Seen()
    config = quick(algorithm="fedavg", rounds=5, eval_every=2)
    summary = run({**config, "out": str(tmp_path / "a")}, progress=False, callbacks=[seen])
    assert seen.calls == [
        ("start", 0),
        ("trained", 1),
        ("end", 1, False),
        ("trained", 2),
        ("end", 2, True),
        ("trained", 3),
        ("end", 3, True),  # a stop is evaluated
        ("stop", 3),
    ]
    assert summary["stopped_by"] == "enough" and summary["rounds_completed"] == 3
    plain = run({**config, "rounds": 3, "eval_every": 2, "out": str(tmp_path / "b")}, progress=False)
    assert plain["final_accuracy"] == summary["final_accuracy"]
