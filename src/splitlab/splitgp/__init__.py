"""SplitGP beyond training: the paper's per-client evaluation (Section VI) and its inference-time
model (Section V). Training itself is `splitlab.algorithms.splitgp`."""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError

from splitlab.config import _one_line, check_finite, check_no_booleans
from splitlab.errors import UserError

Settings = TypeVar("Settings", bound=BaseModel)


def parse_settings(cls: type[Settings], raw: dict) -> Settings:
    """KEY=VALUE settings of a command -> its settings model; a mistake is one UserError line."""
    unknown = sorted(set(raw) - set(cls.model_fields))
    if unknown:
        raise UserError(f"unknown key {unknown[0]!r}; allowed: {', '.join(cls.model_fields)}")
    check_no_booleans(cls.model_fields, raw)
    try:
        settings = cls(**raw)
    except ValidationError as err:
        raise UserError(_one_line(err)) from None
    check_finite(settings)
    return settings
