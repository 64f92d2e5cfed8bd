"""splitlab's messages: stdlib `logging` under the "splitlab" logger, one line per record.

On a terminal, records go through rich's handler (colours, wrapped to the window); anywhere else
(logs, CI, nohup, pipes) as plain lines, never wrapped. A handler writes a record whole under its
lock, so lines from several threads (a server's gRPC threads) never run together. The handler
writes to whatever `sys.stderr` is when the record comes, so redirecting stderr later works.
The handler is set up when splitlab is imported (its messages were always on stderr); to route
them elsewhere, replace the handlers of `logging.getLogger("splitlab")`.
"""

from __future__ import annotations

import logging
import sys

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
