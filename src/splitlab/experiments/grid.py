"""Sweep files and their grid: a base run config, axes whose product is the grid, per-point overrides.

A sweep file (YAML; the format is documented in docs/experiments.md):

    base:                      # a run config; every grid point starts from it
      dataset: digits
      model: mlp
      rounds: 2
    axes:                      # key -> non-empty list of values; the grid is their product
      algorithm: [sfl_v1, sfl_v2, fedavg]
      cut: [1, 2]
      seed: [0, 1]
    exclude:                   # optional: drop grid points matching every key of an entry
      - {algorithm: fedavg, cut: 2}
    overrides:                 # optional, applied in order to matching grid points
      - when: {algorithm: fedavg}            # a list value means "any of"
        set: {optimizer: sgd, lr: 0.01}
    report:                    # optional: defaults for `splitlab report`
      target_accuracy: 0.8
    pretrain:                  # optional: a run config of its own (not merged with base), run
      algorithm: centralized   #   first into <sweep dir>/pretrain; every grid point then starts
      train_range: "0:0.5"     #   from its model (init = that directory)
    description: free text     # optional

Everything is validated, and every grid point is resolved with `resolve_config`, before the
first run starts. Each run gets the directory `<sweep dir>/<run name>`, where the run name is
made from the axis values only (`algorithm=sfl_v2__cut=1__seed=0`). Running the grid is
`splitlab.experiments.sweep`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from splitlab.errors import UserError, not_a_file, unknown_key

log = logging.getLogger(__name__)


TOP_LEVEL_KEYS = ("base", "axes", "exclude", "overrides", "report", "description", "pretrain")


PRETRAIN = "pretrain"  # the pretraining run's name (a grid point's name always holds "=")


REPORT_KEYS = ("target_accuracy",)


_RESERVED = ("out", "resume", "overwrite")  # set per run by the sweep


_MAX_NAME = 200


_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def load_sweep(path_or_dict: str | os.PathLike | Mapping) -> tuple[dict, str]:
    """Read and structurally validate a sweep; returns (spec, stem). Raises UserError.

    `stem` is the file name without extension (`"sweep"` for a dict); it names the default
    output directory `runs/<stem>` and appears in error messages.
    """
    if isinstance(path_or_dict, Mapping):
        spec, stem, where = dict(path_or_dict), "sweep", "sweep"
    else:
        path = Path(path_or_dict)
        stem, where = path.stem, str(path)
        if not path.is_file():
            raise UserError(f"sweep file {path}: {not_a_file(path)}")
        try:
            spec = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"{where}: invalid YAML{at}: {problem}") from None
        except UnicodeDecodeError:
            raise UserError(f"{where}: not a UTF-8 text file") from None
        except RecursionError:
            raise UserError(f"{where}: nests deeper than YAML can be read") from None
    _check_spec(spec, where)
    return spec, stem


def _check_spec(spec: Any, where: str) -> None:
    if not isinstance(spec, dict):
        raise UserError(
            f"{where}: a sweep file must be a mapping with keys 'base' and 'axes', got {type(spec).__name__}"
        )
    unknown = [k for k in spec if k not in TOP_LEVEL_KEYS]
    if unknown:
        raise UserError(f"{where}: {unknown_key(unknown[0], TOP_LEVEL_KEYS)}")
    for key in ("base", "axes"):
        if key not in spec:
            raise UserError(f"{where}: missing '{key}:' (a sweep file needs 'base' and 'axes')")
    base, axes = spec["base"], spec["axes"]
    if base is None:
        base = spec["base"] = {}
    if not isinstance(base, dict):
        raise UserError(f"{where}: 'base' must be a mapping of run keys, got {type(base).__name__}")
    if not isinstance(axes, dict) or not axes:
        raise UserError(f"{where}: 'axes' must be a non-empty mapping of key -> list of values")
    for key in _RESERVED:
        if key in base or key in axes:
            raise UserError(
                f"{where}: '{key}' is set per run by the sweep (out = <sweep dir>/<run name>, "
                f"finished runs are skipped, others resumed); remove it from base/axes"
            )
    for key, values in axes.items():
        if not isinstance(key, str):
            raise UserError(f"{where}: axis name {key!r} must be a string")
        if not isinstance(values, list):
            raise UserError(f"{where}: axes.{key} must be a list of values, got {values!r}")
        if not values:
            raise UserError(f"{where}: axes.{key} is empty; give at least one value")
        for i, v in enumerate(values):
            if v in values[:i]:
                raise UserError(f"{where}: axes.{key} lists {v!r} twice")
    _check_exclude(spec, where)
    _check_overrides(spec, where)
    _check_pretrain(spec, where)
    report = spec.get("report")
    if report is not None:
        if not isinstance(report, dict):
            raise UserError(f"{where}: 'report' must be a mapping; allowed keys: {', '.join(REPORT_KEYS)}")
        for k in report:
            if k not in REPORT_KEYS:
                raise UserError(f"{where}: unknown key report.{k}; allowed: {', '.join(REPORT_KEYS)}")
        if "target_accuracy" in report:
            check_target(report["target_accuracy"], f"{where}: report.target_accuracy")


def check_target(value: Any, what: str = "target accuracy") -> float:
    """A target accuracy is a fraction in (0, 1]; returns it as a float or raises UserError."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UserError(f"{what} must be a fraction in (0, 1] (e.g. 0.8 for 80%), got {value!r}")
    return float(value)


def _check_exclude(spec: dict, where: str) -> None:
    exclude = spec.get("exclude")
    if exclude is None:
        spec["exclude"] = []
        return
    axes = spec["axes"]
    if not isinstance(exclude, list):
        raise UserError(f"{where}: 'exclude' must be a list of mappings axis -> value")
    for i, entry in enumerate(exclude):
        if not isinstance(entry, dict) or not entry:
            raise UserError(f"{where}: exclude[{i}] must be a non-empty mapping axis -> value, got {entry!r}")
        for key, cond in entry.items():
            if key not in axes:
                raise UserError(
                    f"{where}: exclude[{i}] names {key!r}, which is not an axis; axes: {', '.join(map(str, axes))}"
                )
            options = cond if isinstance(cond, list) and cond not in axes[key] else [cond]
            for v in options:
                if v not in axes[key]:
                    raise UserError(f"{where}: exclude[{i}].{key} = {v!r} is not a value of axes.{key} ({axes[key]!r})")


def _check_overrides(spec: dict, where: str) -> None:
    overrides = spec.get("overrides")
    if overrides is None:
        spec["overrides"] = []
        return
    base, axes = spec["base"], spec["axes"]
    if not isinstance(overrides, list):
        raise UserError(f"{where}: 'overrides' must be a list of {{when: {{...}}, set: {{...}}}}")
    for i, entry in enumerate(overrides):
        if not isinstance(entry, dict) or set(entry) != {"when", "set"}:
            raise UserError(f"{where}: overrides[{i}] must have exactly the keys 'when' and 'set', got {entry!r}")
        when, assign = entry["when"], entry["set"]
        if not isinstance(when, dict) or not when:
            raise UserError(f"{where}: overrides[{i}].when must be a non-empty mapping key -> value")
        if not isinstance(assign, dict) or not assign:
            raise UserError(f"{where}: overrides[{i}].set must be a non-empty mapping key -> value")
        for key in when:
            if key not in base and key not in axes:
                raise UserError(
                    f"{where}: overrides[{i}].when uses {key!r}, which is set in neither "
                    f"base nor axes; set it in base to match on it"
                )
        for key in assign:
            if key in axes:
                raise UserError(
                    f"{where}: overrides[{i}].set changes the axis {key!r}; run names come "
                    f"from axis values, so use 'exclude' to drop grid points instead"
                )
            if key in _RESERVED:
                raise UserError(f"{where}: overrides[{i}].set may not set {key!r}; it is set per run")


def _check_pretrain(spec: dict, where: str) -> None:
    pretrain = spec.get(PRETRAIN)
    if pretrain is None:
        return
    if not isinstance(pretrain, dict) or not pretrain:
        raise UserError(f"{where}: 'pretrain' must be a non-empty mapping of run keys (the pretraining run's config)")
    for key in _RESERVED:
        if key in pretrain:
            raise UserError(f"{where}: pretrain.{key} is set by the sweep (out = <sweep dir>/pretrain); remove it")
    sets_init = "init" in spec["base"] or "init" in spec["axes"] or any("init" in o["set"] for o in spec["overrides"])
    if sets_init:
        raise UserError(f"{where}: 'init' is set by 'pretrain' (every run starts from <sweep dir>/pretrain); remove it")


def _matches(config: Mapping, conditions: Mapping) -> bool:
    """Every key equals its condition; a list condition means "any of" (or the list itself)."""
    for key, cond in conditions.items():
        value = config.get(key)
        if value == cond:
            continue
        if isinstance(cond, list) and any(value == c for c in cond):
            continue
        return False
    return True


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "-".join(_format_value(v) for v in value) or "empty"
    if isinstance(value, dict):
        return "-".join(f"{k}-{_format_value(v)}" for k, v in value.items()) or "empty"
    return str(value)


def _safe(text: str) -> str:
    return _UNSAFE.sub("-", text) or "empty"


def run_name(axis_values: Mapping[str, Any]) -> str:
    """`{'algorithm': 'sfl_v2', 'cut': 1}` -> `'algorithm=sfl_v2__cut=1'`: deterministic and
    safe as a directory name on Linux, macOS and Windows (`dirichlet:0.1` -> `dirichlet-0.1`).
    Names longer than 200 characters are shortened with a hash of the full name."""
    name = "__".join(f"{_safe(str(k))}={_safe(_format_value(v))}" for k, v in axis_values.items())
    name = name.lstrip(".-") or "run"  # keys are identifiers in practice; never a hidden name
    if len(name) > _MAX_NAME:
        digest = hashlib.sha1(name.encode()).hexdigest()[:12]
        name = f"{name[: _MAX_NAME - 14]}__{digest}"
    return name


def _grid(spec: dict) -> list[dict]:
    axes = spec["axes"]
    points = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())]
    return [p for p in points if not any(_matches(p, e) for e in spec["exclude"])]


def _resolve(config: dict) -> dict:
    """The fully validated config with every default, as a flat dict; raises UserError."""
    from splitlab.resolve import resolve_config

    return resolve_config(config).as_dict()


@dataclass
class GridPoint:
    name: str
    config: dict  # base + axis values + overrides + out: what engine.run gets
    resolved: dict  # the same with every default filled in
    axis_values: dict


def expand_points(spec: dict, where: str, sweep_dir: Path) -> list[GridPoint]:
    """Every grid point, named and validated with resolve_config."""

    points = _grid(spec)
    if not points:
        raise UserError(f"{where}: 'exclude' removes every grid point; nothing to run")
    used = [False] * len(spec["overrides"])
    seen: dict[str, dict] = {}
    out = []
    start: dict[str, Any] = {}
    if spec.get(PRETRAIN) is not None:  # first, as the others start from its model
        config = {**spec[PRETRAIN], "out": str(sweep_dir / PRETRAIN)}
        try:
            resolved = _resolve(config)
        except UserError as e:
            raise UserError(f"{where}: pretrain: {e}") from None
        out.append(GridPoint(PRETRAIN, config, resolved, {}))
        start = {"init": str(sweep_dir / PRETRAIN)}
    for point in points:
        name = run_name(point)
        if name in seen:
            raise UserError(
                f"{where}: axis values {seen[name]!r} and {point!r} give the same run "
                f"name {name!r}; make the values differ in letters or digits"
            )
        seen[name] = point
        config = {**spec["base"], **point, **start}
        for i, entry in enumerate(spec["overrides"]):
            if _matches(config, entry["when"]):
                config.update(entry["set"])
                used[i] = True
        config["out"] = str(sweep_dir / name)
        try:
            resolved = _resolve(config)
        except UserError as e:
            raise UserError(f"{where}: run {name}: {e}") from None
        out.append(GridPoint(name, config, resolved, point))
    for i, u in enumerate(used):
        if not u:
            log.warning("%s: overrides[%d] (when %r) matches no grid point", where, i, spec["overrides"][i]["when"])
    return out


def expand_sweep(
    path_or_dict: str | os.PathLike | Mapping, out: str | os.PathLike | None = None
) -> list[tuple[str, dict]]:
    """The sweep's grid as [(run name, run config)], in grid order (the first axis varies
    slowest). A run config is base + the point's axis values + matching overrides, with `out` =
    `<sweep dir>/<run name>` (sweep dir default `runs/<file stem>`): exactly what the sweep
    passes to `engine.run`. Every point is validated with `resolve_config` first; any invalid
    point raises UserError naming the run and the bad key or value."""
    spec, stem = load_sweep(path_or_dict)
    where = stem if isinstance(path_or_dict, Mapping) else str(path_or_dict)
    sweep_dir = Path(out) if out is not None else Path("runs") / stem
    return [(p.name, p.config) for p in expand_points(spec, where, sweep_dir)]
