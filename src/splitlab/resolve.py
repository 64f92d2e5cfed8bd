"""A run's settings resolved: its plugins imported, then RunConfig and the chosen algorithm's
Params validated together, and every key checked to apply. It sits above both the settings schema
(splitlab.config) and the algorithms (whose Params build on that schema), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from splitlab.algorithms import get_algorithm
from splitlab.config import (
    ResolvedConfig,
    RunConfig,
    check_applicable,
    check_finite,
    check_no_booleans,
    one_line,
)
from splitlab.errors import UserError, unknown_key
from splitlab.plugins import load_plugins
from splitlab.privacy.defenses import check_applies


def resolve_config(raw: Mapping[str, Any]) -> ResolvedConfig:
    """Validate a flat dict of settings against RunConfig and the algorithm's Params, after
    importing the plugins it names (they may define the algorithm, model or dataset it uses)."""
    plugins = raw.get("plugins")
    if plugins is not None and not isinstance(plugins, str):
        raise UserError(f"invalid value {plugins!r} for plugins: expected module names, comma-separated")
    load_plugins(plugins)

    algorithm = get_algorithm(raw.get("algorithm", RunConfig.model_fields["algorithm"].default))
    raw = two_cuts(raw)
    common = set(RunConfig.model_fields)
    own = set(algorithm.Params.model_fields)
    for key in raw:
        if key not in common and key not in own:
            raise unknown_key(key, common | own, f"algorithm {algorithm.name!r}")
    check_no_booleans({**RunConfig.model_fields, **algorithm.Params.model_fields}, raw)
    check_finite(raw)
    try:
        run = RunConfig(**{k: v for k, v in raw.items() if k in common})
        params = algorithm.Params(**{k: v for k, v in raw.items() if k in own})
    except ValidationError as err:
        raise UserError(one_line(err)) from None
    check_finite(run)
    check_finite(params)
    check_applies(run, "server_model" in algorithm.models)
    check_u_shape(run)
    check_applicable(run, raw)
    return ResolvedConfig(with_model_sizes(run), params)


def with_model_sizes(run: RunConfig) -> RunConfig:
    """`model=gpt`'s sizes that were not given set to its defaults, so that `config.yaml` and the
    export say what the run used (`context: 256`, not `context: null`)."""
    if run.model != "gpt":
        return run
    import inspect

    from splitlab.models.gpt import gpt

    defaults = {key: p.default for key, p in inspect.signature(gpt).parameters.items() if key in GPT_SIZES}
    return run.model_copy(update={key: defaults[key] for key in GPT_SIZES if getattr(run, key) is None})


#: `model=gpt`'s own settings (`splitlab.models.gpt.gpt`'s keyword arguments)
GPT_SIZES = ("layers", "heads", "width", "context")


def two_cuts(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """`cut=A,B` (or a YAML list [A, B]) -> cut=A, tail_cut=B; anything else as given."""
    cut = raw.get("cut")
    if isinstance(cut, list) or (isinstance(cut, str) and "," in cut):
        items = cut if isinstance(cut, list) else cut.split(",")
        try:
            first, second = (int(str(item).strip()) for item in items)
        except ValueError:
            raise UserError(f"invalid value {cut!r} for cut: expected a cut C, or two cuts A,B (U-shaped)") from None
        if "tail_cut" in raw:
            raise UserError(f"cut={cut} and tail_cut={raw['tail_cut']} both give the second cut; give it once")
        return {**raw, "cut": first, "tail_cut": second}
    return raw


def check_u_shape(run: RunConfig) -> None:
    """A U-shaped split's cuts in order, on an algorithm it fits, or one line saying what is wrong."""
    if run.tail_cut is None:
        return
    if run.tail_cut <= run.cut:
        raise UserError(
            f"cut={run.cut},{run.tail_cut}: the cuts are out of order; a U-shaped split needs cut=A,B with A < B"
        )
    algorithm = get_algorithm(run.algorithm)
    if not algorithm.supports_u_shape:
        why = algorithm.not_u_shaped or "it does not declare U-shape support (supports_u_shape, docs/extending.md)"
        raise UserError(
            f"tail_cut={run.tail_cut} (cut={run.cut},{run.tail_cut}, U-shaped) does not fit "
            f"algorithm={run.algorithm}: {why}"
        )
