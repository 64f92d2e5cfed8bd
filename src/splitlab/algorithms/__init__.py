"""Algorithm registry: every `Algorithm` subclass with a `name`, wherever and whenever it is defined.

Adding an algorithm is adding one file here, or defining a subclass in a module of your own
(loaded with `plugins=`, docs/extending.md). The registry is not cached: a subclass defined after
a first run is known to the next one.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

from splitlab.errors import UserError
from splitlab.plugins import named_subclasses

if TYPE_CHECKING:
    from splitlab.algorithms.base import Algorithm


@functools.cache
def _import_builtin() -> None:
    """Import every module of this package once, so that its algorithms are defined."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def algorithms() -> dict[str, type[Algorithm]]:
    """name -> class, for every subclass of `Algorithm` that sets its own `name`
    (splitlab.plugins.named_subclasses)."""
    from splitlab.algorithms.base import Algorithm

    _import_builtin()
    return named_subclasses(Algorithm, "algorithm")


def algorithm_names() -> list[str]:
    return sorted(algorithms())


def get_algorithm(name: object) -> type[Algorithm]:
    registry = algorithms()
    if not isinstance(name, str) or name not in registry:
        raise UserError(f"unknown algorithm {name!r}; available: {', '.join(sorted(registry))}")
    return registry[name]
