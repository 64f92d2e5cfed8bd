"""splitlab's messages: stdlib `logging` under the "splitlab" logger, one line per record.

On a terminal, records go through rich's handler (colours, wrapped to the window); anywhere else
(logs, CI, nohup, pipes) as plain lines, never wrapped. A handler writes a record whole under its
lock, so lines from several threads (a server's gRPC threads) never run together. The handler
writes to whatever `sys.stderr` is when the record comes, so redirecting stderr later works.
The handler is set up when splitlab is imported (its messages were always on stderr); to route
them elsewhere, replace the handlers of `logging.getLogger("splitlab")`.

Long work says how far it is (`progress`, `Lines`): a rich bar on a terminal, elsewhere a plain
line every `LINE_SECONDS` ("tokenising shakespeare_lm: 40% (1.2M of 3.0M characters)"), so that
a run under nohup or CI is never silent for minutes.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator

LOGGER = logging.getLogger("splitlab")
#: --quiet / default / --verbose
LEVELS = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}


class _PlainHandler(logging.StreamHandler):
    """One line per record to the current sys.stderr."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr  # (under the handler's lock; the earlier stream may be closed by now)
        super().emit(record)


def _terminal_handler() -> logging.Handler:
    from rich.console import Console
    from rich.logging import RichHandler

    handler = RichHandler(
        console=Console(stderr=True, highlight=False), show_time=False, show_path=False, show_level=False, markup=False
    )
    handler.set_name(_TERMINAL)
    return handler


_TERMINAL = "splitlab-terminal"


def setup_logging(verbosity: int = 0, force: bool = False) -> None:
    """Give the "splitlab" logger its handler and level (verbosity -1: warnings and errors only;
    1: debug too). Without `force`, a logger that has handlers already is left as it is."""
    if LOGGER.handlers and not force:
        return
    for earlier in list(LOGGER.handlers):
        if isinstance(earlier, _PlainHandler) or earlier.get_name() == _TERMINAL:
            LOGGER.removeHandler(earlier)
    handler = _terminal_handler() if sys.stderr.isatty() else _PlainHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(LEVELS[max(-1, min(1, verbosity))])
    LOGGER.propagate = False  # one copy of each line, whatever the root logger does


#: seconds between two progress lines where stderr is not a terminal; work done sooner says nothing
LINE_SECONDS = 5.0


def clock() -> float:
    """The progress lines' clock (a test replaces it)."""
    return time.monotonic()


def amount(count: float) -> str:
    """1234567 -> '1.2M', 4321 -> '4.3k', 12 -> '12'."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if count >= scale:
            return f"{count / scale:.1f}{suffix}"
    return f"{count:g}"


class Lines:
    """Work toward `total` `unit`s as plain lines, one every LINE_SECONDS at most, for output that
    is not a terminal: "title: 40% (1.2M of 3.0M unit)"."""

    def __init__(self, title: str, total: float, unit: str) -> None:
        self.title, self.total, self.unit = title, total, unit
        self.done = 0.0
        self.last = clock()

    def advance(self, count: float = 1) -> None:
        self.done += count
        now = clock()
        if now - self.last >= LINE_SECONDS:
            self.last = now
            LOGGER.info(self.line())

    def line(self) -> str:
        share = f"{100 * self.done / self.total:.0f}% " if self.total else ""
        return f"{self.title}: {share}({amount(self.done)} of {amount(self.total)} {self.unit})"


@contextlib.contextmanager
def progress(title: str, total: float, unit: str) -> Iterator[Callable[[float], None]]:
    """Shows work toward `total` while the block runs, which calls the yielded `advance(count)`: a
    bar that disappears when done on a terminal, `Lines` elsewhere; nothing under --quiet."""
    if not LOGGER.isEnabledFor(logging.INFO):
        yield lambda count: None
    elif not sys.stderr.isatty():
        yield Lines(title, total, unit).advance
    else:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(title, total=total)
            yield lambda count: bar.advance(task, count)
