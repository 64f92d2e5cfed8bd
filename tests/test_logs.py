"""splitlab's messages through logging: on stderr whatever stderr is now, one whole line per
message from many threads at once, --quiet keeping only warnings."""

from __future__ import annotations

import logging
import sys
import threading

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
