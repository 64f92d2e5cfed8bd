"""setting=vertical data=own: each party process reads only its own CSV file of its columns (the
label holder's with the labels), the server none; it plans the run from the parties' reports. The
run is bit for bit `splitlab run` on the table that joins their files; a file or report that does
not fit is refused in one line."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import launch_in_threads
from safetensors.torch import load_file
from sklearn.datasets import load_breast_cancer

from splitlab.build import build, client_node
from splitlab.cli import main
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.net.launch import LaunchSettings, launch
from splitlab.resolve import resolve_config
from splitlab.settings.vertical import _as_when_begun, own_report, plan_own_server

CONFIG = dict(
    setting="vertical", algorithm="sl", dataset="csv", model="mlp", labels_at=0, rounds=2, local_steps=2, seed=0
)
GROUPS = (range(0, 15), range(15, 30))


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        csv.writer(file).writerows([header, *rows])


def write_tables(folder: Path, labels_at: int | str) -> dict[str, Path]:
    """breast_cancer as a CSV table with shuffled ids (for `run`), and its columns 0-14 and 15-29
    as party 0's and party 1's own files, the labels in party `labels_at`'s, or in the server's
    file of ids and labels. Party 0 lacks training rows 0-19 (empty cells in the joined table),
    party 1 rows 380-399; the labels of rows 100-104 are unknown: the parties' private set
    intersection leaves 355 rows."""
    x, y = load_breast_cancer(return_X_y=True)
    ids = np.random.default_rng(3).permutation(10_000)[: len(y)] + 5
    folders = {name: folder / name for name in ("whole", "party0", "party1", "server")}
    for split, rows in (("train", range(400)), ("test", range(400, len(y)))):
        whole, parts, server = [], [[], []], []
        for i in rows:
            label = "" if 100 <= i < 105 else int(y[i])
            held = [not i < 20, not 380 <= i < 400] if split == "train" else [True, True]
            cells = [[repr(float(x[i, c])) if held[j] else "" for c in GROUPS[j]] for j in range(2)]
            whole.append([ids[i], *cells[0], *cells[1], label])
            server.append([ids[i], label])
            for j in range(2):
                if held[j]:
                    parts[j].append([ids[i], *cells[j], *([label] if j == labels_at else [])])
        write_csv(folders["whole"] / f"{split}.csv", ["id", *(f"c{c}" for c in range(30)), "label"], whole)
        write_csv(folders["server"] / f"{split}.csv", ["id", "label"], server)
        for j in range(2):
            header = ["id", *(f"c{c}" for c in GROUPS[j]), *(["label"] if j == labels_at else [])]
            write_csv(folders[f"party{j}"] / f"{split}.csv", header, parts[j])
    return folders


def run_joined(tables: dict[str, Path], config: dict, out: Path) -> None:
    """`splitlab run` on the table that joins the parties' files, their columns as the groups."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the processes: a matmul's sums in other orders differ in the last bits
    try:
        run({**config, "data_dir": str(tables["whole"]), "features": "0-14/15-29", "out": str(out)}, progress=False)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def tables(tmp_path) -> dict[str, Path]:
    return write_tables(tmp_path, 0)


@pytest.mark.parametrize("labels_at", [0, "server"])
def test_own_files_give_what_run_gives_on_the_joined_table(tmp_path, labels_at):
    """What `splitlab launch data=own data_dirs=P0,P1` runs, in threads of this process (the last
    test launches processes)."""
    tables = write_tables(tmp_path, labels_at)
    config = {**CONFIG, "labels_at": labels_at}
    run_joined(tables, config, tmp_path / "run")
    mine = {"data_dir": str(tables["server"])} if labels_at == "server" else {}  # ids and labels, no feature
    folders = LaunchSettings(data_dirs=f"{tables['party0']},{tables['party1']}")
    server = launch_in_threads({**config, "data": "own", "out": str(tmp_path / "net"), **mine}, {}, folders)
    assert isinstance(server.ended[0], dict), server.ended
    here, there = (
        load_file(tmp_path / "run" / "weights.safetensors"),
        load_file(tmp_path / "net" / "weights.safetensors"),
    )
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
    keys = ("test_accuracy", "test_loss", "test_f1", "train_loss", "comm_bytes_by_kind")
    rows = [
        [json.loads(line) for line in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        for out in ("run", "net")
    ]
    assert [[row[k] for k in keys] for row in rows[0]] == [[row[k] for k in keys] for row in rows[1]]
    report = json.loads((tmp_path / "net" / "partition.json").read_text())
    assert report == {
        "setting": "vertical",
        "features": [list(GROUPS[0]), list(GROUPS[1])],
        "held_before_alignment": [375 if labels_at == 0 else 380, 380],
        "aligned": 355,
    }
    assert any("client 1 holds 380 samples" in line for line in server.lines)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"dataset": "breast_cancer"}, "dataset=breast_cancer cannot be used with setting=vertical data=own"),
        ({"features": "0-14/15-29"}, "features=0-14/15-29 cannot be used with setting=vertical data=own"),
        ({}, "no process holds every party's columns; run the server with `splitlab server`"),
    ],
)
def test_what_data_own_cannot_do_is_refused(tmp_path, keys, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("`", ".")):
        build({**CONFIG, "data": "own", "out": str(tmp_path / "run"), **keys})


def test_a_party_file_unlike_its_place_is_refused(tmp_path, tables):
    own = {**CONFIG, "data": "own"}
    with pytest.raises(UserError, match="has a 'label' column; only the label holder's"):
        client_node({**own, "data_dir": str(tables["party0"])}, 1)  # labels_at=0: party 1 holds none
    with pytest.raises(UserError, match="has no 'label' column"):
        client_node({**own, "data_dir": str(tables["party1"])}, 0)
    bad = tmp_path / "bad"
    write_csv(bad / "train.csv", ["key", "c0"], [[1, 0.5]])
    write_csv(bad / "test.csv", ["key", "c0"], [[2, 0.5]])
    with pytest.raises(UserError, match="has no 'id' column"):
        client_node({**own, "data_dir": str(bad)}, 1)
    write_csv(bad / "train.csv", ["id", "c0"], [[1, 0.5], [1, 0.7]])
    with pytest.raises(UserError, match="an id appears twice"):
        client_node({**own, "data_dir": str(bad)}, 1)
    reports = {j: {"samples": 50, **own_report(15, np.arange(10), 2)} for j in range(2)}
    at_server = resolve_config({**own, "labels_at": "server", "data_dir": str(tables["party0"])})
    with pytest.raises(UserError, match="has feature columns .*; the server's holds only 'id' and 'label'"):
        plan_own_server(at_server, reports)
    node = client_node({**own, "data_dir": str(tables["party1"])}, 1)
    assert node.reported["columns"] == 15 and node.reported["test_samples"] == 169 and node.reported["classes"] == 0


def test_parties_with_other_test_samples_are_refused():
    reports = {j: {"samples": 50, **own_report(15, np.arange(10 + j), 2 if j == 0 else 0)} for j in range(2)}
    with pytest.raises(
        UserError, match=r"party 1's test.csv holds other test samples \(11 rows .* than party 0's \(10\)"
    ):
        plan_own_server(resolve_config({**CONFIG, "data": "own"}), reports)
    reports[1] = {"samples": 50, **own_report(15, np.arange(10), 0)}
    plan = plan_own_server(resolve_config({**CONFIG, "data": "own"}), reports)
    assert [list(g) for g in plan.plan.groups] == [list(GROUPS[0]), list(GROUPS[1])] and plan.holding.test_samples == 10


def test_a_resume_with_other_files_is_refused(tmp_path):
    """The parties of a resumed run must bring the files it began with (its partition.json), not
    others that the checkpoint's models would go on with silently."""
    report = {
        "setting": "vertical",
        "features": [list(GROUPS[0]), list(GROUPS[1])],
        "held_before_alignment": [375, 380],
    }
    (tmp_path / "partition.json").write_text(json.dumps({**report, "aligned": 355}))
    config = resolve_config({**CONFIG, "data": "own", "out": str(tmp_path), "resume": True})
    _as_when_begun(config, {**report, "aligned": 355})
    with pytest.raises(
        UserError, match=r"the parties' files give held_before_alignment \[375, 379\], not \[375, 380\]"
    ):
        _as_when_begun(config, {**report, "held_before_alignment": [375, 379], "aligned": 355})
    _as_when_begun(resolve_config({**CONFIG, "data": "own", "out": str(tmp_path)}), {**report, "aligned": 354})


def test_launch_from_per_party_folders_gives_what_run_gives_on_the_joined_table(tmp_path, capsys):
    """`splitlab launch data=own data_dirs=P0,P1` starts the server and one party per folder (its
    certificates made): bit for bit `splitlab run` on the table that joins the parties' files.
    `splitlab evaluate` on it says in one line why it cannot, and where the final metrics are."""
    tables = write_tables(tmp_path, 0)
    run_joined(tables, CONFIG, tmp_path / "run")
    folders = f"{tables['party0']},{tables['party1']}"
    config = {**CONFIG, "data": "own", "out": str(tmp_path / "net")}
    assert launch(config, {}, LaunchSettings(data_dirs=folders), progress=False) == 0
    here, there = (
        load_file(tmp_path / "run" / "weights.safetensors"),
        load_file(tmp_path / "net" / "weights.safetensors"),
    )
    assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here)
    capsys.readouterr()
    assert main(["evaluate", str(tmp_path / "net")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs every party's columns of the test samples in one process" in err
    assert "are in its summary.json" in err and not (tmp_path / "net" / "evaluation.json").exists()


@pytest.mark.parametrize(
    ("data_dirs", "message"),
    [
        (None, r"launch data=own needs data_dirs=DIR0,DIR1,...: each client's \(vertical: each party's\) own folder"),
        ("party0", "data_dirs= names 1 folders; this run has 2 nodes, one folder each"),
        ("party0,nowhere", "data_dirs=: '.*nowhere' is not a folder"),
    ],
)
def test_launch_from_per_party_folders_refuses_a_bad_list_before_writing(tables, tmp_path, data_dirs, message):
    named = [] if data_dirs is None else [str(tables["whole"].parent / name) for name in data_dirs.split(",")]
    folders = ",".join(named) or None
    out = tmp_path / "net"
    with pytest.raises(UserError, match=message):
        launch({**CONFIG, "data": "own", "out": str(out)}, {}, LaunchSettings(data_dirs=folders), progress=False)
    assert not out.exists()
