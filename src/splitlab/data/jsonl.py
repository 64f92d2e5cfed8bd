"""`dataset=jsonl data_file=PATH`: a JSON Lines file of rows in one of the formats of
data/text_rows.py (`text`, `prompt` + `completion`, `messages`), one JSON object per line; blank
lines are skipped. Any malformed line is refused with its number (and, for a byte that is not
UTF-8, its offset in the file; for bad JSON, its column)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from splitlab.data.text_rows import Rows, read_rows
from splitlab.errors import UserError, not_utf8
from splitlab.json_text import user_json


def _lines(path: Path) -> Iterator[tuple[str, Any]]:
    try:
        with path.open(encoding="utf-8") as file:
            for number, line in enumerate(file, 1):
                if line.strip():
                    where = f"{path}, line {number}"
                    yield where, user_json(line.rstrip("\r\n"), where)
    except UnicodeDecodeError:
        raise UserError(f"{path}, {not_utf8(path)}") from None


def read_jsonl(path: Path, key: str = "data_file") -> Rows:
    """The rows of the JSONL file at `path` (given as `key`=), checked."""
    try:
        return read_rows(_lines(path), str(path))
    except OSError as error:
        raise UserError(f"{key}={path}: cannot read it ({error.strerror})") from None
