"""splitlab's messages through logging: on stderr whatever stderr is now, one whole line per
message from many threads at once, --quiet keeping only warnings."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from splitlab.cli import main
from splitlab.logs import setup_logging

log = logging.getLogger("splitlab.test")


def test_messages_go_to_the_current_stderr_even_after_it_was_replaced_and_closed(capsys, monkeypatch):
    import io

    old = io.StringIO()
    monkeypatch.setattr(sys, "stderr", old)
    log.info("first")
    old.close()
    monkeypatch.undo()
    log.info("second")
    assert capsys.readouterr().err == "second\n"


def test_lines_from_many_threads_never_run_together(capsys):
    def say(k: int) -> None:
        for i in range(50):
            log.info(f"thread {k} line {i} " + "x" * 200)

    threads = [threading.Thread(target=say, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 400 and all(line.startswith("thread ") and line.endswith("x" * 200) for line in lines)


def test_quiet_keeps_warnings_and_errors_only(capsys):
    try:
        assert main(["run", "--quiet", "lrr=1"]) == 2
        log.info("not shown")
        log.warning("shown")
        assert capsys.readouterr().err == "error: unknown key 'lrr' for algorithm 'sfl_v2'; did you mean 'lr'?\nshown\n"
    finally:
        setup_logging(0, force=True)


def test_without_a_terminal_long_work_says_how_far_it_is_every_few_seconds(tmp_path, monkeypatch, capsys):
    """A clock that moves LINE_SECONDS per reading: every step of work is "a few seconds" later."""
    import itertools
    import json

    from splitlab import logs
    from splitlab.data import load_dataset
    from splitlab.engine import run

    ticks = itertools.count()
    monkeypatch.setattr(logs, "clock", lambda: next(ticks) * logs.LINE_SECONDS)
    data_file = tmp_path / "rows.jsonl"
    data_file.write_text("".join(json.dumps({"text": f"To be, or not to be, {i}."}) + "\n" for i in range(40)))
    config = dict(dataset="jsonl", data_file=str(data_file), model="gpt", layers=1, heads=2, width=8, context=16)
    run({**config, "seq_len": 16, "clients": 2, "rounds": 2, "batch_size": 4, "out": str(tmp_path / "run")})
    lines = capsys.readouterr().err.splitlines()
    # 36 training rows of 855 characters, each and its end a token: 55 sequences, 28 + 27 on two clients
    assert lines[0] == "tokenising jsonl train: 100% (855 of 855 characters)"
    assert lines[1].startswith("tokenising jsonl test: 100% (")
    batches = [line for line in lines if line.startswith("round ") and "client batches" in line]
    assert len(load_dataset("jsonl", seq_len=16, data_file=data_file).train_y) == 55
    assert batches[:2] == ["round 1/2: 7% (1 of 14 client batches)", "round 1/2: 14% (2 of 14 client batches)"]
    assert batches[-1] == "round 2/2: 100% (14 of 14 client batches)" and len(batches) == 28
    assert lines[-1].startswith("round 2/2  acc ")  # the evaluated round's line, as before


def every_algorithm() -> list[dict]:
    from splitlab.algorithms import algorithm_names

    vertical = dict(setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", parties=2)
    return [dict(algorithm=name) for name in algorithm_names()] + [vertical]


@pytest.mark.parametrize("settings", every_algorithm(), ids=lambda s: s.get("setting", s["algorithm"]))
def test_a_round_draws_the_client_batches_its_progress_counts_on(settings):
    """The total a round's progress line counts toward is what its clients draw."""
    from helpers import quick
    from splitlab.engine import build

    vertical = "setting" in settings
    experiment = build({**settings, "device": "cpu"} if vertical else quick(train_subset=200, **settings))
    drawn = []
    experiment.blueprint.on_batch = lambda: drawn.append(1)
    experiment.algorithm.run_round(0, experiment.clients)
    expected = experiment.algorithm.round_batches(experiment.clients)
    assert len(drawn) == (expected or 0) and (expected is None) == vertical
