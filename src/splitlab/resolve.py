"""A run's settings resolved: its plugins imported, then RunConfig and the chosen algorithm's
Params validated together, and every key checked to apply. It sits above both the settings schema
(splitlab.config) and the algorithms (whose Params build on that schema), so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from splitlab.algorithms import algorithms, get_algorithm
from splitlab.config import (
    ResolvedConfig,
    RunConfig,
    check_applicable,
    check_finite,
    check_no_booleans,
    from_text,
    other_name,
)
from splitlab.data import parse_partition_scheme
from splitlab.errors import UserError, one_line, unknown_key
from splitlab.models import MODEL_INPUTS, MODEL_PARAMS, NoModelParams, model_params
from splitlab.plugins import load_plugins
from splitlab.privacy.defenses import check_applies, parse_defense


def resolve_config(raw: Mapping[str, Any]) -> ResolvedConfig:
    """Validate a flat dict of settings against RunConfig, the algorithm's Params and the model's
    params, after importing the plugins it names (they may define the algorithm, model or dataset
    it uses). Values given as text (the command line's) are read by their key's type."""
    plugins = raw.get("plugins")
    if plugins is not None and not isinstance(plugins, str):
        raise UserError(f"invalid value {plugins!r} for plugins: expected module names, comma-separated")
    load_plugins(plugins)

    algorithm = get_algorithm(raw.get("algorithm", RunConfig.model_fields["algorithm"].default))
    model_name = raw.get("model", RunConfig.model_fields["model"].default)
    model = model_params(model_name) if isinstance(model_name, str) else NoModelParams
    raw = without_null_model_keys(two_cuts(raw))
    common, own, model_own = set(RunConfig.model_fields), set(algorithm.Params.model_fields), set(model.model_fields)
    for key in raw:
        if key not in common | own | model_own:
            raise misplaced_key(key, algorithm.name, str(model_name))
    fields = {**RunConfig.model_fields, **algorithm.Params.model_fields, **model.model_fields}
    raw = from_text(fields, raw)
    check_no_booleans(fields, raw)
    check_finite(raw)
    try:
        run = RunConfig(**{k: v for k, v in raw.items() if k in common})
        params = algorithm.Params(**{k: v for k, v in raw.items() if k in own})
        model_settings = model(**{k: v for k, v in raw.items() if k in model_own})
    except ValidationError as err:
        raise UserError(one_line(err)) from None
    for settings in (run, params, model_settings):
        check_finite(settings)
    parse_partition_scheme(run.partition)  # the named schemes and defenses live above the schema
    parse_defense(run.defense)
    check_applies(run, "server_model" in algorithm.models)
    check_u_shape(run)
    check_fp16(run)
    check_federated(run)
    check_secagg_neighbours(run)
    check_step_options(run)
    check_vectorize(run, params)
    check_packing(run)
    check_applicable(run, raw)
    if run.eval_generate:
        run.decoding(room=1)  # the eval_* keys agree
    check_model_fits(run)
    return ResolvedConfig(with_seq_len(run), params, algorithm, model_settings)


def with_seq_len(run: RunConfig) -> RunConfig:
    """`run` with a language dataset's sequence length as used: its default where none is given, so
    that config.yaml reruns the same thing and the model's checks before the data see it."""
    from splitlab.data.language import SEQ_LENS

    if run.seq_len is not None or run.dataset not in SEQ_LENS:
        return run
    return run.model_copy(update={"seq_len": SEQ_LENS[run.dataset]})


def without_null_model_keys(raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` less the models' keys given as null, which means their default: the config.yaml of a run
    from before models owned their keys records every model's keys, null where not given."""
    model_keys = set().union(*(params.model_fields for params in MODEL_PARAMS.values()))
    return {key: value for key, value in raw.items() if not (value is None and key in model_keys)}


def misplaced_key(key: str, algorithm: str, model: str) -> UserError:
    """A key the run's algorithm and model do not take: which algorithms or models it applies to,
    or the closest key name."""
    from splitlab.algorithms import algorithms

    hint = other_name(key)
    if hint is not None:
        return UserError(hint)
    takers = sorted(name for name, cls in algorithms().items() if key in cls.Params.model_fields)
    if takers:
        return UserError(f"{key} applies to algorithm {_listed(takers)}, not {algorithm}")
    takers = sorted(name for name, params in MODEL_PARAMS.items() if key in params.model_fields)
    if takers:
        return UserError(f"{key} applies to model {_listed(takers)}, not {model}")
    known = set(RunConfig.model_fields).union(
        *(cls.Params.model_fields for cls in algorithms().values()),
        *(params.model_fields for params in MODEL_PARAMS.values()),
    )
    return unknown_key(key, known, f"algorithm {algorithm!r}")


def _listed(names: list[str]) -> str:
    """a | a and b | a, b and c"""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_fp16(run: RunConfig) -> None:
    """precision=fp16 where its loss scaling reaches every backward pass and what crosses, or one line."""
    if run.precision != "fp16":
        return
    algorithm = get_algorithm(run.algorithm)
    why = ""
    if not algorithm.supports_fp16:
        why = f"algorithm={run.algorithm} does not declare it (supports_fp16, docs/extending.md)"
    elif parse_defense(run.defense).noises_gradients:
        why = f"defense={run.defense}: noise on cut gradients is drawn for unscaled float32 values"
    elif run.model == "lstm" and run.device != "cuda":
        why = "model=lstm: torch has no float16 LSTM kernel on the CPU (device=cuda has one)"
    if why:
        raise UserError(f"precision=fp16 does not apply here: {why}; precision=bf16 needs no loss scaling")


def as_typed(value: object) -> str:
    """A key's value as a user types it: true/false, none, else as it is."""
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_federated(run: RunConfig) -> None:
    """The federated half's keys (FedProx, FedOpt, SCAFFOLD) where they hold, or one line: on an
    algorithm whose sync server averages client parts (`Algorithm.averaged`), the server optimizer
    and SCAFFOLD where clients start every round from that average, SCAFFOLD with plain SGD."""
    given = {
        key: getattr(run, key)
        for key in ("prox_mu", "server_opt", "server_opt_lr", "scaffold", "secure_aggregation")
        if getattr(run, key) != RunConfig.model_fields[key].default
    }
    if not given:
        return
    algorithm = get_algorithm(run.algorithm)
    key, value = next(iter(given.items()))
    why = ""
    if not algorithm.averaged:
        why = algorithm.not_averaged or "it declares no client parts its sync server averages (Algorithm.averaged)"
    elif algorithm.not_from_average and set(given) - {"prox_mu", "secure_aggregation"}:
        key = next(k for k in given if k not in ("prox_mu", "secure_aggregation"))
        value, why = given[key], algorithm.not_from_average
    elif run.secure_aggregation:
        key, value, why = "secure_aggregation", True, secure_aggregation_refusal(run)
    elif run.scaffold and (run.optimizer != "sgd" or run.momentum):
        key, value = "scaffold", True
        why = (
            "SCAFFOLD's option II estimates a client's gradient as (x - y_i) / (K lr), which holds for plain SGD "
            "steps: give optimizer=sgd without momentum"
        )
    if why:
        raise UserError(f"{key}={as_typed(value)} does not apply to algorithm={run.algorithm}: {why}")


def secure_aggregation_refusal(run: RunConfig) -> str:
    """Why secure aggregation cannot hold in this run ('' where it can)."""
    if run.scaffold:
        return "SCAFFOLD's Delta c_i would reach the sync server one client at a time, in the clear"
    if run.backend == "ray":
        return "it is simulated in process: a client's round secrets do not move between Ray actors"
    if run.clients != "all" and max(1, round(run.participation * run.clients)) < 3:
        return (
            f"a round of {max(1, round(run.participation * run.clients))} client(s) (participation x clients): the "
            "sum of fewer than 3 gives a client's part away to the others"
        )
    return ""


def check_secagg_neighbours(run: RunConfig) -> None:
    """secagg_neighbours=K where SecAgg+'s K-regular graph can be drawn among a round's clients, or one
    line (without secure_aggregation, config.ONLY_WHEN refuses it)."""
    degree = run.secagg_neighbours
    if degree is None or not run.secure_aggregation:
        return
    why = ""
    round_size = None if run.clients == "all" else max(1, round(run.participation * run.clients))
    if degree % 2:
        why = "the graph joins each client to K/2 clients on either side of it on a ring: give an even K"
    elif round_size is not None and degree >= round_size:
        why = f"a round has {round_size} clients (participation x clients); give fewer neighbours than that"
    if why:
        raise UserError(f"secagg_neighbours={degree} does not apply: {why}")


def check_step_options(run: RunConfig) -> None:
    """clip_scope=global, keep_client_optimizer and a per-step schedule where the algorithm says
    they apply (docs/language.md), or one line."""
    algorithm = get_algorithm(run.algorithm)
    if run.clip_scope == "global":
        why = ""
        if not algorithm.clips_whole_model:
            why = f"algorithm={run.algorithm} does not train client and server parts in one step on one loss"
        elif run.precision == "fp16":
            why = "precision=fp16 skips steps on either side of the cut by its own loss scale"
        if why:
            raise UserError(f"clip_scope=global does not apply here: {why}; use clip_scope=part")
    if run.keep_client_optimizer and not algorithm.can_keep_client_optimizer:
        takers = sorted(name for name, cls in algorithms().items() if cls.can_keep_client_optimizer)
        raise UserError(
            f"keep_client_optimizer does not apply to algorithm={run.algorithm}: its clients do not receive a new "
            f"copy of their part every round; it applies to {_listed(takers)}"
        )
    if run.save_every and algorithm.personal_models:
        raise UserError(
            f"save_every does not apply to algorithm={run.algorithm}: it has no one global model to save, "
            f"each client keeps its own part"
        )
    if run.lr_by_step and algorithm.no_step_schedule:
        raise UserError(
            f"warmup_steps, warmup_ratio and lr_decay do not apply to algorithm={run.algorithm}: "
            f"{algorithm.no_step_schedule}; use lr_schedule (by round)"
        )


def check_vectorize(run: RunConfig, params: BaseModel) -> None:
    """vectorize=true where one batched computation can stand in for the round's clients, or one
    line saying why not (the model's own limits are checked when it is built: splitlab.vectorized)."""
    if not run.vectorize:
        return
    given = {
        "backend": (run.backend, "local"),
        "transport": (run.transport, "direct"),
        "precision": (run.precision, "fp32"),
        "grad_accum": (run.grad_accum, 1),
        "defense": (run.defense, "none"),
        "record": (run.record, 0),
        "lora": (run.lora, None),
        "tail_cut": (run.tail_cut, None),
        "gradient_checkpointing": (run.gradient_checkpointing, False),
        # the federated half's client terms and server steps, and per-step schedules and clipping across
        # the cut, are the roles' (splitlab.strategies, schedules): the stacked steps take none of them
        "prox_mu": (run.prox_mu, 0),
        "scaffold": (run.scaffold, False),
        "secure_aggregation": (run.secure_aggregation, False),
        "server_opt": (run.server_opt, "avg"),
        "server_opt_lr": (run.server_opt_lr, 1),
        "clip_scope": (run.clip_scope, "part"),
        "keep_client_optimizer": (run.keep_client_optimizer, False),
        "warmup_steps": (run.warmup_steps, 0),
        "warmup_ratio": (run.warmup_ratio, 0),
        "lr_decay": (run.lr_decay, "none"),
    }
    algorithm = get_algorithm(run.algorithm)
    why = algorithm.not_vectorized(params)
    if not algorithm.supports_vectorize:
        takers = sorted(name for name, cls in algorithms().items() if cls.supports_vectorize)
        why = f"algorithm={run.algorithm} does not declare it (supports_vectorize: {_listed(takers)} do)"
    for key, (value, needed) in given.items():
        if not why and value != needed:
            why = f"it needs {key}={as_typed(needed)}, not {key}={as_typed(value)}"
    if why:
        raise UserError(f"vectorize=true does not apply here: {why}")


def check_packing(run: RunConfig) -> None:
    """packing=true where every step's segment ids reach each part that runs on the batch (the
    client's with its batch, the server's with the smashed data), or one line saying why not."""
    if not run.packing:
        return
    why = ""
    if not get_algorithm(run.algorithm).supports_packing:
        why = f"algorithm={run.algorithm} does not declare it (supports_packing: sl, psl, sfl_v1 and sfl_v2 do)"
    elif run.setting != "vanilla" or run.tail_cut is not None:
        why = "it needs a split at one cut of clients holding whole rows (setting=vanilla, no tail_cut)"
    else:
        for key, value, needed in (
            ("vectorize", run.vectorize, False),  # the stacked steps run the parts on no ids
            ("grad_accum", run.grad_accum, 1),  # micro-batches would need the ids split alike
            ("record", run.record, 0),  # a record (and the attacks on it) keeps no ids
            ("test_split", run.test_split, "global"),  # held-out packed rows would be evaluated as one
        ):
            if value != needed:
                why = f"it needs {key}={str(needed).lower()}, not {key}={str(value).lower()}"
                break
    if why:
        raise UserError(f"packing=true does not apply here: {why}")


def check_model_fits(run: RunConfig) -> None:
    """A model that cannot take the dataset's samples (an image CNN on tokens) is refused in one
    line, from what both declare, before any data is loaded."""
    from splitlab.data import SAMPLES

    takes, holds = MODEL_INPUTS.get(run.model), SAMPLES.get(run.dataset)
    if takes is None or holds is None or holds in takes:
        return
    fitting = sorted(name for name, kinds in MODEL_INPUTS.items() if holds in kinds)
    raise UserError(
        f"model={run.model} takes {' or '.join(sorted(takes))}, but dataset={run.dataset} holds {holds}; "
        f"models for {holds}: {', '.join(fitting)}"
    )


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
