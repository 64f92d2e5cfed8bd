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

WIDTH = 100
#: command -> its settings models, as module:class
SETTINGS = {
    "server": ["splitlab.net.server:ServerSettings"],
    "launch": ["splitlab.net.launch:LaunchSettings", "splitlab.net.server:ServerSettings"],
    "client": ["splitlab.net.client:ClientSettings"],
    "evaluate": ["splitlab.splitgp_evaluation:EvaluationSettings"],
    "latency": ["splitlab.splitgp_latency:LatencySettings"],
    "attack": ["splitlab.audit.settings:AttackSettings"],
    "advise": ["splitlab.audit.settings:AdviseSettings"],
    "certs": ["splitlab.net.certs:CertsSettings"],
    **dict.fromkeys(["models", "algorithms", "datasets"], ["splitlab.plugins:ListingSettings"]),
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


def grouped(model: type[BaseModel]) -> dict[str, list[str]]:
    """A settings model's keys by the concern their field is tagged with (`json_schema_extra`'s
    group; RunConfig's: splitlab.config.GROUPS, in that order), untagged keys last, under "other"."""
    from splitlab.config import GROUPS

    groups: dict[str, list[str]] = {group: [] for group in GROUPS}
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        groups.setdefault(str(extra.get("group", "other")), []).append(name)
    return {group: keys for group, keys in groups.items() if keys}


def run_keys() -> str:
    """The keys of `run`: those of every run, then each algorithm's own, then each model's own."""
    from splitlab.algorithms import algorithms
    from splitlab.config import RunConfig
    from splitlab.models import MODEL_PARAMS

    parts = [
        section(f"keys of every run (KEY=VALUE): {group}", [row for row in rows(RunConfig) if row[0] in keys])
        for group, keys in grouped(RunConfig).items()
    ]
    for name, cls in sorted(algorithms().items()):
        own = rows(cls.Params)
        if own:
            parts.append(section(f"keys of algorithm={name}", own))
    for name, params in sorted(MODEL_PARAMS.items()):
        parts.append(section(f"keys of model={name}", rows(params)))
    return "\n\n".join(parts)


def command_keys(command: str, plugins: str | None = None) -> str:
    """The `--help` epilog of `command`: its keys, from its settings models (with `plugins`: the
    algorithms and models those modules define too)."""
    if plugins is not None:
        from splitlab.errors import UserError
        from splitlab.plugins import load_plugins

        try:
            load_plugins(plugins)
        except UserError as err:
            return f"(keys not listed: {err})"
    if command == "run":
        return run_keys()
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
