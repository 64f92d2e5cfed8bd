"""`splitlab attack RUN attack=...`: attacks on a finished run (the curious server's, a malicious
server's, and model completion). The attack is looked up in the registry (splitlab.audit.attack),
the run checked against what it declares it needs, and its target built here once for all.

Targets are what the server saw during training when the run was made with `record=N` (the last
recorded round by default, `round=` another), otherwise what it would see from the final model:
held-out test samples through the final client part, with the run's defense applied. The
server's auxiliary data is a seeded part of the test split, disjoint from those held-out samples.
Results go to RUN/attack.json (one entry per attack) and, for the reconstructions, RUN/attack_<attack>.png.
Image runs take `inversion`, `unsplit`, `fsha`, `label_leak` and `model_completion`, table runs
`inversion`, `label_leak` and `model_completion`, language runs `token_inversion`; vertical runs
`inversion` per party and `label_leak` (splitlab.audit.vertical). `fsha` is different: an active
attack during training, simulated afresh on the run's configuration and data, not played on what
the run recorded.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from splitlab import rundir
from splitlab.algorithms import get_algorithm
from splitlab.audit.attack import TEXT_RECOVERED, Attack, Target, attack_named, check_inputs, check_vertical, inputs_of
from splitlab.audit.records import as_produced, attack_sizes, chosen_round, load_round, record_files
from splitlab.audit.settings import AttackSettings
from splitlab.config import UNSPLIT_ALGORITHMS, RunConfig
from splitlab.errors import UserError
from splitlab.io import write_json
from splitlab.models import HeadAndTail, load_shared, output_shape
from splitlab.plugins import load_plugins
from splitlab.settings import stored_setting

RESULTS = "attack.json"
STRONGEST = "strongest"  # attack.json's entry of the strongest figures (no attack takes the name)


def attack_run(run_dir: str | Path, raw: dict) -> dict[str, Any]:
    """Run one attack on a finished run; returns its result, also merged into RUN/attack.json."""
    from splitlab.config import parse_settings

    settings = parse_settings(AttackSettings, raw)
    load_plugins(settings.plugins)
    attack = attack_named(settings.attack)
    path = Path(run_dir)
    stored = rundir.stored_config(path, "attack", "point attack at a finished run's directory")
    if not stored_setting(stored).whole_samples:  # parties holding features: played per party
        from splitlab.audit.vertical import vertical_target

        vertical = vertical_target(path, stored, settings, check_vertical(settings.attack))
        head = {"attack": settings.attack, "targets": vertical.source, "defense": vertical.config.run.defense}
        found = {**head, **attack().run_vertical(vertical)}
    else:
        target = _target(path, stored, settings, attack)
        head = {
            "attack": settings.attack,
            "targets": target.source,
            "defense": target.experiment.config.run.defense,
            "weights": attack.weights,  # what the attacker knows of the client part: the trained or pretrained weights
            **({"client_weights": target.client_weights} if attack.weights == "final" else {}),
        }
        found = {**head, **attack().run(target)}
    earlier = json.loads((path / RESULTS).read_text()) if (path / RESULTS).is_file() else {}
    entries = {**earlier, settings.attack: {"settings": settings.model_dump(), **found}}
    entries[STRONGEST] = strongest(entries)
    write_json(path / RESULTS, entries)
    kinds = set(attack.figures.values())
    beside = [row for row in entries[STRONGEST] if row["figure"] in kinds and row["targets"] == found["targets"]]
    return {**found, STRONGEST: beside} if beside else found


def strongest(entries: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kind of figure (`Attack.figures`) and targets, the highest figure over the attacks run
    (attack.json's entries): which attack and attacker got it, and the attacks of that kind not yet
    run on the run's inputs (each may be stronger)."""
    from splitlab.audit.attack import attacks

    known = attacks()
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for name, entry in entries.items():
        cls = known.get(name)
        for key, kind in (cls.figures if cls is not None else {}).items():
            value: Any = entry
            for part in key.split("."):  # a figure nested in the result: "per_batch.norm_auc_median"
                value = value.get(part) if isinstance(value, dict) else None
            if not isinstance(value, int | float):
                continue
            group = (kind, entry["targets"])
            row = best.setdefault(group, {"figure": kind, "targets": entry["targets"], "value": value, "run": []})
            row["run"].append(name)
            if value >= row["value"]:
                row.update(value=value, attack=name, attacker=entry.get("attacker", key))
    for row in best.values():
        inputs = {i for name in row["run"] for i in known[name].inputs}
        row["not_run"] = [
            name
            for name, cls in known.items()
            if row["figure"] in cls.figures.values() and name not in row["run"] and inputs & set(cls.inputs)
        ]
    return list(best.values())


def strongest_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """The strongest figures beside an attack's own, as `splitlab attack` prints them."""
    rows = []
    for row in result.get(STRONGEST, []):
        value = f"{row['value']:.2%}" if row["figure"] == TEXT_RECOVERED else f"{row['value']:.3f}"
        rows.append((f"strongest {row['figure']} so far ({row['attack']}: {row['attacker']})", value))
        if row["not_run"]:
            rows.append(("  not run yet on this run (attack=...)", ", ".join(row["not_run"])))
    return rows


def _target(path: Path, stored: dict[str, Any], settings: AttackSettings, attack: type[Attack]) -> Target:
    """The target of `attack` on the horizontal run in `path`, refused in one line where the run
    does not have what the attack declares it needs."""
    from splitlab.finished_run import final_states, load_run

    algorithm = stored.get("algorithm") or RunConfig().algorithm
    personal = get_algorithm(algorithm).personal_models
    if settings.client and not personal:
        raise UserError(
            f"client={settings.client} does not apply: {algorithm} has one global model, not per-client ones"
        )
    if algorithm in UNSPLIT_ALGORITHMS:
        raise UserError(f"{str(path)!r} is a {algorithm} run: nothing is split, no cut to attack")
    recorded_rounds = record_files(path)  # stray or misnamed files refused before any work
    experiment = load_run(path, settings.device)
    if settings.client >= len(experiment.clients):
        raise UserError(
            f"client={settings.client} is not a client of {str(path)!r}; allowed: 0 to {len(experiment.clients) - 1}"
        )
    data = experiment.data
    check_inputs(attack, inputs_of(data.task, data.test_x), data.task, path)
    client, server = typing.cast(nn.Sequential, experiment.assemble(final_states(experiment, settings.client)))
    shapes = {
        "inputs": tuple(data.test_x.shape[1:]),
        "smashed": output_shape(client, tuple(data.test_x.shape[1:]), data.test_x.dtype),
        "labels": tuple(data.test_y.shape[1:]),  # a language task's targets: one per position
    }
    # what the server infers labels from: the cut gradient it sends, or U-shaped the gradient it receives at B
    gradient = "tail_grad" if isinstance(client, HeadAndTail) else "cut_grad"
    if gradient == "tail_grad":
        shapes["tail_grad"] = output_shape(nn.Sequential(client, server), shapes["inputs"], data.test_x.dtype)
    num_classes = experiment.blueprint.num_classes
    chosen = chosen_round(path, recorded_rounds, settings.round)
    recorded, weights = None, "the run's final client part"
    if chosen is not None:
        tensors, state = as_produced(*load_round(recorded_rounds[chosen], shapes, num_classes), settings.client)
        recorded = (chosen, tensors)
        if state is not None and attack.replays_record:  # attack the record with the client part that made it
            _load_client(client, state, recorded_rounds[chosen])
            weights = f"the client part round {chosen} started with"
    order = np.random.default_rng([settings.seed, len(data.test_y)]).permutation(len(data.test_y))
    held_out, aux = attack_sizes(
        len(order), settings.aux, settings.targets, held_out=recorded is None or not attack.replays_record
    )
    aux_idx = torch.as_tensor(order[held_out : held_out + aux], device=data.test_y.device)
    target_idx = torch.as_tensor(order[:held_out], device=data.test_y.device)
    return Target(
        path=path,
        settings=settings,
        experiment=experiment,
        client=client,
        server=server,
        defense=experiment.blueprint.defense,
        x=data.test_x[target_idx],
        y=data.test_y[target_idx],
        recorded=recorded,
        recorded_rounds=recorded_rounds,
        shapes=shapes,
        order=order,
        held_out=held_out,
        aux_x=data.test_x[aux_idx],
        gradient=gradient,
        source=f"recorded round {recorded[0]}" if recorded else f"{held_out} held-out test samples, final model",
        client_weights=weights,
    )


def _load_client(client: nn.Module, state: dict[str, torch.Tensor], file: Path) -> None:
    try:
        load_shared(client, state)
    except RuntimeError as error:
        reason = " ".join(str(error).split())[:200]
        raise UserError(f"{str(file)!r} is not a record of this run: its client weights do not fit: {reason}") from None
