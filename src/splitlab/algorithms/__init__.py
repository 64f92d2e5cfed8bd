"""Algorithm registry: every `Algorithm` subclass with a `name` in this package, found by import.

Adding an algorithm is adding one file here.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

from splitlab.errors import UserError

if TYPE_CHECKING:
    from splitlab.algorithms.base import Algorithm


def _discover() -> dict[str, type[Algorithm]]:
    from splitlab.algorithms.base import Algorithm

    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found: dict[str, type[Algorithm]] = {}
    pending = list(Algorithm.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if "name" in vars(cls):
            found[cls.name] = cls
    return found


_REGISTRY: dict[str, type[Algorithm]] | None = None


def algorithms() -> dict[str, type[Algorithm]]:
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = _discover()
    return _REGISTRY


def algorithm_names() -> list[str]:
    return sorted(algorithms())


def get_algorithm(name: object) -> type[Algorithm]:
    registry = algorithms()
    if not isinstance(name, str) or name not in registry:
        raise UserError(f"unknown algorithm {name!r}; available: {', '.join(sorted(registry))}")
    return registry[name]
