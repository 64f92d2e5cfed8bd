"""Code from outside the package: user modules that define algorithms, models and datasets.

A plugin is an ordinary Python module. Importing it is all it takes: an `Algorithm` subclass with
a `name` is found by the registry, and `splitlab.register_model` / `splitlab.register_dataset`
add to the model and dataset registries. Plugins come from two places, both imported before a
config is resolved, in every process that resolves one (the CLI, sweep workers, networked
clients, Ray actors): the `plugins=MODULE[,MODULE]` key, and the entry-point group
`splitlab.plugins` of installed packages (docs/extending.md).
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from splitlab.errors import UserError

ENTRY_POINT_GROUP = "splitlab.plugins"

Named = TypeVar("Named")


class ListingSettings(BaseModel):
    """The keys of `splitlab models | algorithms | datasets`: plugins whose items to list too."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    plugins: str | None = Field(None, description="modules of your own to import first, comma-separated")


def parse_plugins(value: str | None) -> list[str]:
    """`a.b,c` -> ["a.b", "c"]; each a dotted module name."""
    names = [name.strip() for name in (value or "").split(",") if name.strip()]
    for name in names:
        if not all(part.isidentifier() for part in name.split(".")):
            raise UserError(f"invalid value {value!r} for plugins: {name!r} is not a module name (e.g. my_algorithms)")
    return names


def load_plugins(value: str | None) -> None:
    """Import the installed packages' plugins (once per process) and the modules `value` names.
    The current directory is searched first, as `python -m` does, so that a module in the folder a
    command is started from is found."""
    _load_entry_points()
    names = parse_plugins(value)
    if names and str(Path.cwd()) not in sys.path and "" not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    for name in names:
        _import(name, f"plugins={value}")


def ray_options(value: str | None) -> dict[str, Any]:
    """Options of Ray actors and tasks under which their processes import the plugins `value` names
    as this process did: a runtime_env with the folders they were imported from on PYTHONPATH (on a
    cluster, those folders must exist on every node, as a sweep's directory must; an installed
    plugin package needs none). No plugins: no options."""
    folders = [str(_folder(name)) for name in parse_plugins(value)]
    if not folders:
        return {}
    inherited = os.environ.get("PYTHONPATH")
    paths = os.pathsep.join(dict.fromkeys([*folders, *filter(None, [inherited])]))
    return {"runtime_env": {"env_vars": {"PYTHONPATH": paths}}}


def _folder(name: str) -> Path:
    """The sys.path entry module `name` (imported already) was found under."""
    top = importlib.import_module(name.partition(".")[0])
    origin = Path(str(top.__file__))
    return origin.parent.parent if origin.name == "__init__.py" else origin.parent


@functools.cache
def _load_entry_points() -> None:
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        _import(entry.value.partition(":")[0], f"entry point {entry.name!r} of group {ENTRY_POINT_GROUP}")


def _import(name: str, where: str) -> None:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if name == missing or name.startswith(missing + "."):  # the plugin itself, not one of its imports
            raise UserError(
                f"plugin module {name!r} ({where}) is not importable from {str(Path.cwd())!r} or sys.path; "
                f"start from its folder or add that folder to PYTHONPATH"
            ) from None
        raise


def named_subclasses(base: type[Named], kind: str) -> dict[str, type[Named]]:
    """name -> class, for every subclass of `base` that sets its own `name` (splitlab's and the
    plugins'), in the order they were defined. Two classes claiming one name is an error, unless
    one is a redefinition of the other (a module run again): then the later one counts. `kind`
    names what they are in that error (algorithm, attack)."""
    found: dict[str, type[Named]] = {}
    pending = collections.deque(base.__subclasses__())
    while pending:
        cls = pending.popleft()
        pending.extend(cls.__subclasses__())
        if "name" not in vars(cls):
            continue
        name = vars(cls)["name"]
        earlier = found.get(name)
        if earlier is not None and _qualified(earlier) != _qualified(cls):
            raise UserError(
                f"{kind} name {name!r} is taken twice: by {_qualified(earlier)} and by {_qualified(cls)}; rename one"
            )
        found[name] = cls
    return found


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
