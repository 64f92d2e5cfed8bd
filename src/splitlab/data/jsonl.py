"""`dataset=jsonl data_file=PATH`: a JSON Lines file of rows in one of the formats of
data/text_rows.py (`text`, `prompt` + `completion`, `messages`), one JSON object per line; blank
lines are skipped. Any malformed line is refused with its number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from splitlab.data.text_rows import Rows, read_rows
from splitlab.errors import UserError


def _lines(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if not line.strip():
                    continue
                where = f"{path}, line {number}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as error:
                    raise UserError(f"{where}: not a JSON object ({error.msg}); expected one per line") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def read_jsonl(path: Path, key: str = "data_file") -> Rows:
    """The rows of the JSONL file at `path` (given as `key`=), checked."""
    try:
        return read_rows(_lines(path), str(path))
    except OSError as error:
        raise UserError(f"{key}={path}: cannot read it ({error.strerror})") from None
