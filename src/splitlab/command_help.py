"""Every command's keys, for its `--help`: generated from the settings models, never typed twice.

Imported only when help is asked for: building it imports the models (and torch with them).
"""

from __future__ import annotations

import importlib
import textwrap
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

#: `splitlab certs` keys (a command too small for a settings model): name -> (default, description)
CERTS_KEYS: dict[str, tuple[Any, str]] = {
    "out": ("certs", "directory to write ca, server and client certificates and keys to"),
    "clients": (1, "how many client certificates"),
    "hosts": (None, "names or addresses, comma-separated, the server certificate is also valid for"),
    "overwrite": (False, "replace an existing CA (every key it issued stops working)"),
}
WIDTH = 100
#: command -> its settings models, as module:class
SETTINGS = {
    "server": ["splitlab.net.server:ServerSettings"],
    "launch": ["splitlab.net.launch:LaunchSettings", "splitlab.net.server:ServerSettings"],
    "client": ["splitlab.net.client:ClientSettings"],
    "evaluate": ["splitlab.splitgp_evaluation:EvaluationSettings"],
    "latency": ["splitlab.splitgp_latency:LatencySettings"],
    "attack": ["splitlab.audit.settings:AttackSettings"],
    "advise": ["splitlab.audit.advise:AdviseSettings"],
    "generate": ["splitlab.runmodel:GenerateSettings"],
}


def rows(model: type[BaseModel]) -> list[tuple[str, Any, str]]:
    """(key, default, description) of every field of a settings model ("(required)" where none)."""
    return [
        (name, "(required)" if field.default is PydanticUndefined else field.default, field.description or "")
        for name, field in model.model_fields.items()
    ]


def section(title: str, entries: Iterable[tuple[str, Any, str]]) -> str:
    """A titled list of keys: `key=default` then its description, indented and wrapped."""
    lines = [f"{title}:"]
    for name, default, description in entries:
        shown = "none" if default is None else str(default).lower() if isinstance(default, bool) else default
        lines.append(f"  {name}={shown}")
        if description:
            lines.extend(textwrap.wrap(description, WIDTH, initial_indent=" " * 6, subsequent_indent=" " * 6))
    return "\n".join(lines)


def run_keys() -> str:
    """The keys of `run`: those of every run, then each algorithm's own."""
    from splitlab.algorithms import algorithms
    from splitlab.config import RunConfig

    parts = [section("keys of every run (KEY=VALUE)", rows(RunConfig))]
    for name, cls in sorted(algorithms().items()):
        own = rows(cls.Params)
        if own:
            parts.append(section(f"keys of algorithm={name}", own))
    return "\n\n".join(parts)


def command_keys(command: str) -> str:
    """The `--help` epilog of `command`: its keys, from its settings models."""
    if command == "run":
        return run_keys()
    if command == "certs":
        return section("keys", ((k, d, text) for k, (d, text) in CERTS_KEYS.items()))
    try:
        models = _models(command)
    except ImportError as missing:  # an optional extra that is not installed
        return f"(its keys are listed once the package {missing.name!r} is installed)"
    parts = [section(f"keys of {command}", rows(model)) for model in models]
    if command in ("server", "launch"):
        parts.append(run_keys())
    return "\n\n".join(parts)


def _models(command: str) -> list[type[BaseModel]]:
    """The settings models of `command`, imported now."""
    found = []
    for path in SETTINGS.get(command, ()):
        module, _, name = path.partition(":")
        found.append(getattr(importlib.import_module(module), name))
    return found
