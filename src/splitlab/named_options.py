"""Settings written `name[:number[:number...]]` (`loss=focal:2`, `augment=crop:4`), made by a registry
that plugins add to: one parser, one set of messages, for every such key."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Generic, TypeVar

from splitlab.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> (make(*numbers) -> T, its form for messages, e.g. "focal:<gamma>")."""

    def __init__(self, what: str, built_in: dict[str, tuple[Callable[..., T], str]]) -> None:
        self.what = what
        self.entries = dict(built_in)
        self.built_in = frozenset(built_in)

    def register(self, name: str, make: Callable[..., T], form: str | None = None) -> None:
        """`name:a:b` makes `make(a, b)` (the numbers as floats). A plugin's name may be registered
        again (the later counts), a built-in one may not."""
        if not name.isidentifier() or name in self.built_in:
            raise UserError(
                f"cannot register {self.what} {name!r}: expected a new name (letters, digits, _), not a built-in"
            )
        self.entries[name] = (make, form or name)

    @property
    def forms(self) -> str:
        return ", ".join(form for _, form in self.entries.values())

    def make(self, value: str) -> T:
        """What `value` names; ValueError saying what is allowed."""
        name, *args = value.split(":")
        if name not in self.entries:
            raise ValueError(f"unknown {self.what} {name!r}; expected one of {self.forms}")
        make, form = self.entries[name]
        try:
            numbers = [float(arg) for arg in args]
            inspect.signature(make).bind(*numbers)
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not {form}; expected one of {self.forms}") from None
        try:
            return make(*numbers)
        except ValueError as error:
            raise ValueError(f"{value!r}: {error} ({form})") from None
