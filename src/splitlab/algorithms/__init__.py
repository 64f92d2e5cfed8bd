"""Algorithm registry: every `Algorithm` subclass with a `name`, wherever and whenever it is defined.

Adding an algorithm is adding one file here, or defining a subclass in a module of your own
(loaded with `plugins=`, docs/extending.md). The registry is not cached: a subclass defined after
a first run is known to the next one.
"""

from __future__ import annotations

import collections
import functools
import importlib
import pkgutil
from typing import TYPE_CHECKING

from splitlab.errors import UserError

if TYPE_CHECKING:
    from splitlab.algorithms.base import Algorithm


@functools.cache
def _import_builtin() -> None:
    """Import every module of this package once, so that its algorithms are defined."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def algorithms() -> dict[str, type[Algorithm]]:
    """name -> class, for every subclass of `Algorithm` that sets its own `name`. Two classes
    claiming one name is an error, unless one is a redefinition of the other (a module run again):
    then the later one counts."""
    from splitlab.algorithms.base import Algorithm

    _import_builtin()
    found: dict[str, type[Algorithm]] = {}
    pending = collections.deque(Algorithm.__subclasses__())  # in the order they were defined
    while pending:
        cls = pending.popleft()
        pending.extend(cls.__subclasses__())
        if "name" not in vars(cls):
            continue
        earlier = found.get(cls.name)
        if earlier is not None and _qualified(earlier) != _qualified(cls):
            raise UserError(
                f"algorithm name {cls.name!r} is taken twice: by {_qualified(earlier)} and by {_qualified(cls)}; "
                f"rename one"
            )
        found[cls.name] = cls
    return found


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def algorithm_names() -> list[str]:
    return sorted(algorithms())


def get_algorithm(name: object) -> type[Algorithm]:
    registry = algorithms()
    if not isinstance(name, str) or name not in registry:
        raise UserError(f"unknown algorithm {name!r}; available: {', '.join(sorted(registry))}")
    return registry[name]
