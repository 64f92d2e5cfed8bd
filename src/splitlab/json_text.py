"""JSON from users' files, parsed without ever exhausting the parser's recursion: nesting is
checked before parsing, and errors say where (line and column). Without torch, so that the config,
the listings and the data readers that need only this import none (codec.py reads tensors)."""

from __future__ import annotations

import json
import re
from typing import Any

from splitlab.errors import UserError

MAX_FILE_DEPTH = 100
"""The deepest nest read from a JSON file a user gives (rows, a model's config.json): deeper is
refused before it is parsed, as it would exhaust the parser's recursion."""


def user_json(text: str, where: str) -> Any:
    """The JSON `text` of a user's file (`where` names it: a file, or a file and a line), parsed; a
    UserError saying where a syntax error is (line and column; the column alone for one line) or
    that it nests deeper than MAX_FILE_DEPTH."""
    try:
        return file_json(text)
    except json.JSONDecodeError as error:
        at = f"column {error.colno}" if "\n" not in text.strip() else f"line {error.lineno}, column {error.colno}"
        raise UserError(f"{where}: not valid JSON ({error.msg} at {at})") from None
    except ValueError as error:
        raise UserError(f"{where}: {error}") from None


def file_json(text: str) -> Any:
    """The JSON `text` of a file, parsed: a ValueError where it is not JSON or nests deeper than
    MAX_FILE_DEPTH (never a RecursionError), for readers that say what a bad file means to them."""
    check_depth(text, MAX_FILE_DEPTH)
    return json.loads(text)


def check_depth(text: str, limit: int) -> None:
    """A ValueError if the JSON `text` nests deeper than `limit` (counted only where it holds more
    brackets than that, so that a long file of shallow lines costs a count, not a scan)."""
    if text.count("[") + text.count("{") > limit and _depth(text) > limit:
        raise ValueError(f"nested deeper than {limit} levels")


def _depth(text: str) -> int:
    """How deep the brackets of the JSON `text` nest (brackets inside strings do not count)."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)
    depth = deepest = 0
    for char in re.sub(r"[^\[\]{}]", "", outside):
        depth += 1 if char in "[{" else -1
        deepest = max(deepest, depth)
    return deepest
