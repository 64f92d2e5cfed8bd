"""`dataset=jsonl data_file=PATH`: a JSON Lines file of rows in one of the formats of
data/text_rows.py (`text`, `prompt` + `completion`, `messages`), one JSON object per line; blank
lines are skipped. Any malformed line is refused with its number (and, for a byte that is not
UTF-8, its offset in the file; for bad JSON, its column)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from splitlab.codec import user_json
from splitlab.data.text_rows import Rows, read_rows
from splitlab.errors import UserError


def _lines(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as file:
        offset = 0
        for number, raw in enumerate(file, 1):
            where = f"{path}, line {number}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise UserError(
                    f"{where}: not UTF-8 text ({error.reason} at byte {offset + error.start} of the file)"
                ) from None
            offset += len(raw)
            if line.strip():
                yield where, user_json(line.rstrip("\r\n"), where)


def read_jsonl(path: Path, key: str = "data_file") -> Rows:
    """The rows of the JSONL file at `path` (given as `key`=), checked."""
    try:
        return read_rows(_lines(path), str(path))
    except OSError as error:
        raise UserError(f"{key}={path}: cannot read it ({error.strerror})") from None
