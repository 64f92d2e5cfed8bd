"""The one exception type that means "the user asked for something invalid".

The CLI turns it into a one-line message and exit code 2; everything else is a bug and keeps
its traceback.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError


class UserError(Exception):
    """A bad value from the user: the message names the value and what is allowed."""


class NonFiniteLoss(UserError):
    """Training diverged (a NaN or infinite loss): the run stops there, its files hold only finite rounds."""

    exit_code = 3


class NonFiniteStep(NonFiniteLoss):
    """A training server's loss or gradient norm came out non-finite, checked before its optimizer
    steps (its model is untouched). Over a network, the client whose data it was is dropped
    (splitlab.algorithms.base); in process, or where no one client is to blame, training diverged."""

    def __init__(self, what: str, value: float) -> None:
        super().__init__(f"the server's {what} became {value}")
        self.what, self.value = what, value


class RoundFailed(UserError):
    """A networked round could not finish (fewer than `min_clients` did, or a client dropped in a step
    its algorithm cannot skip): the run stops at its last checkpoint."""

    exit_code = 4


class RoleLost(Exception):
    """A process holding roles was lost (a Ray actor or its node died): the driver can build the roles
    again and replay from the last checkpoint (engine.run, `max_restarts`)."""


def not_a_file(path: Path) -> str:
    """Why `path`, expected to be a file, is not one: a folder is not "no such file"."""
    return "is a folder, not a file" if path.is_dir() else "no such file"


def not_utf8(path: Path) -> str:
    """Where the file at `path` first stops being UTF-8, `line N: not UTF-8 text (why at byte B of
    the file)`, found again from its bytes: a text reader's error counts from its last chunk."""
    offset = 0
    with path.open("rb") as file:
        for number, line in enumerate(file, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as error:
                return f"line {number}: not UTF-8 text ({error.reason} at byte {offset + error.start} of the file)"
            offset += len(line)
    return "not UTF-8 text"


#: At most this many allowed keys are listed when none is close to an unknown one; more: --help lists them.
LISTED_KEYS = 8


def unknown_key(key: str, allowed: Iterable[str], where: str = "") -> UserError:
    """`unknown key 'lrr' for run; did you mean 'lr'?`; when none is close, the allowed keys if they
    are few, else where they are listed (a line of sixty keys hides what is wrong)."""
    names = sorted(allowed)
    close = difflib.get_close_matches(key, names, n=1)
    if close:
        hint = f"did you mean {close[0]!r}?"
    elif len(names) <= LISTED_KEYS:
        hint = f"allowed: {', '.join(names)}"
    else:
        hint = "the command's --help lists the keys"
    return UserError(f"unknown key {key!r}{f' for {where}' if where else ''}; {hint}")


def one_line(err: ValidationError) -> str:
    """A settings model's refusal as one line naming the key, the value and what is wrong."""
    first = err.errors()[0]
    key = str(first["loc"][0]) if first["loc"] else "config"  # flat settings: the key (not a union branch)
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if first["type"] in _BOUNDS and not _finite(first.get("input")):
        message = "it must be a finite number"  # not "should be <= 1e8", which nan is not either
    return f"invalid value {shown(first.get('input'))} for {key}: {message}"


#: pydantic's refusals of a number out of bounds
_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return True  # not a number at all: pydantic's own message says so


def shown(value: Any) -> str:
    """A value as a message names it: a number as written (whether typed as text or not), else its repr."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return repr(value)
        return value
    return repr(value)


def refuse(settings: object, refusals: Mapping[str, tuple[bool, str]], where: str) -> None:
    """UserError for the first key `refusals` refuses (key -> (refused, why)): `KEY=VALUE cannot be
    used with WHERE WHY`, `where` naming what refuses it with its punctuation (`setting=vertical:`)."""
    for key, (refused, why) in refusals.items():
        if refused:
            raise UserError(f"{key}={getattr(settings, key)} cannot be used with {where} {why}")
