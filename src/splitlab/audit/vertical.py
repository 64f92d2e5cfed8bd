"""`splitlab attack` on a finished vertical run (setting=vertical): what the server learns of each
party's features and what a passive party learns of the labels.

- `inversion`, per party: the server (or a label-holding party, which sees no more) inverts party
  j's embedding back to party j's features (its region of an image, its columns of a table) with
  the learning-based inversion of vanilla runs (`attacks.inversion`, the same decoder and `fit`).
  Assumed, as there: the attacker holds auxiliary samples with party j's features (a seeded part
  of the test split, disjoint from the targets) and party j's final bottom model, and knows the
  defense. Scored per party: SSIM/PSNR for image regions, per-column R^2 and MSE for table
  columns, each against the floor of answering the auxiliary data's mean.
- `label_leak`: every passive party (one without the labels) scores the labels from the gradients
  it receives at its embedding (Li et al. 2022's norm and direction attacks, `attacks.label_leak`).

Targets are what the server saw in a recorded round when the run was made with `record=N` (the
last by default, `round=` another; splitlab.privacy.record.PartyRecorder), otherwise held-out test
samples through the final model, with the run's defense applied.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splitlab.audit import attacks
from splitlab.errors import UserError

if TYPE_CHECKING:
    from splitlab.audit.run import AttackSettings

OFFERED = (
    "offered: inversion (each party's features from its embedding) and label_leak (the labels from the "
    "gradients a passive party receives)"
)
_PARTY_TENSOR = re.compile(r"(inputs|smashed|labels|cut_grad)@(\d+)")


def attack_vertical(path: Path, stored: dict[str, Any], settings: AttackSettings) -> dict[str, Any]:
    """Run `settings.attack` on the vertical run in `path`; its result (the caller keeps it in attack.json)."""
    from splitlab.assembly import test_set
    from splitlab.audit.records import attack_sizes, record_files
    from splitlab.vertical import load_final

    attack = settings.attack
    if attack not in ("inversion", "label_leak"):
        raise UserError(f"attack={attack} is not offered for a vertical run; {OFFERED}")
    if settings.client:
        raise UserError(f"client={settings.client} does not apply to a vertical run: every party is attacked")
    files = record_files(path)  # stray or misnamed files refused before any work
    config, vertical, model = load_final(path, stored, settings.device)
    plan, blueprint = vertical.plan, vertical.blueprint
    recorded = _recorded(path, files, settings.round, model, blueprint.num_classes)
    passive = [j for j in range(plan.parties) if j != plan.labels_at]
    if attack == "label_leak" and not passive:
        raise UserError(f"{str(path)!r} has one party and it holds the labels: no passive party to attack with")
    x, y = test_set(config, vertical.data, blueprint.device)
    order = np.random.default_rng([settings.seed, len(y)]).permutation(len(y))
    if attack == "label_leak":  # held-out targets only: no auxiliary data
        held_out = min(500, len(y)) if settings.targets is None else settings.targets
        if held_out > len(y):
            raise UserError(f"targets={held_out} is more than the {len(y)} test samples of {str(path)!r}")
        aux = 0
    else:
        held_out, aux = attack_sizes(len(y), settings.aux, settings.targets, held_out=recorded is None)
    chosen = torch.as_tensor(order[:held_out], device=y.device)
    aux_x = x[torch.as_tensor(order[held_out : held_out + aux], device=y.device)]
    x, y = x[chosen], y[chosen]
    source = f"recorded round {recorded[0]}" if recorded else f"{held_out} held-out test samples, final model"
    defense = blueprint.defense
    by_party: dict[int, dict[str, Any]] = {}
    try:
        if attack == "label_leak":
            grads = _gradients(model, x, y, config.run.batch_size) if recorded is None else None
            for j in passive:
                if recorded is None:
                    assert grads is not None
                    by_party[j] = attacks.label_leak(grads[j], y)
                elif f"cut_grad@{j}" in recorded[1]:
                    by_party[j] = attacks.label_leak(recorded[1][f"cut_grad@{j}"], recorded[1][f"labels@{j}"])
                else:
                    raise ValueError(f"round {recorded[0]} recorded no gradient for party {j}")
            source += f", passive part{'y' if len(passive) == 1 else 'ies'} {', '.join(map(str, passive))}"
        else:
            for j, bottom in enumerate(model.bottoms):
                if recorded is None:
                    inputs = plan.columns(x, j)
                    smashed = attacks.defended_smashed(bottom, inputs, defense, settings.seed)
                else:
                    inputs, smashed = recorded[1][f"inputs@{j}"], recorded[1][f"smashed@{j}"]
                scores = attacks.inversion(
                    bottom, defense, plan.columns(aux_x, j), smashed, inputs, settings.epochs, settings.seed
                )
                scores.pop("reconstructed")
                by_party[j] = {"columns": list(plan.groups[j]), **scores}
    except ValueError as error:
        raise UserError(f"cannot attack {str(path)!r}: {error}") from None
    first = next(iter(by_party.values()))
    summary = {k: v for k, v in first.items() if k in ("norm_auc", "direction_auc", "scored", "samples")}
    return {"attack": attack, "targets": source, "defense": config.run.defense, **summary, "by_party": by_party}


def _gradients(model: Any, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Per party, the gradient at its embedding the server would send for (x, y) through the final
    model (mean loss over each batch of the run's size)."""
    plan = model.plan
    grads: list[list[torch.Tensor]] = [[] for _ in range(plan.parties)]
    for batch_x, batch_y in zip(x.split(batch_size), y.split(batch_size)):
        embeddings = [
            bottom(plan.columns(batch_x, j)).detach().requires_grad_() for j, bottom in enumerate(model.bottoms)
        ]
        value = torch.nn.functional.cross_entropy(model.top(plan.join(embeddings, model.shapes)), batch_y)
        for j, grad in enumerate(torch.autograd.grad(value, embeddings)):
            grads[j].append(grad)
    return [torch.cat(g) for g in grads]


def _recorded(
    path: Path, files: dict[int, Path], rnd: int | None, model: Any, num_classes: int
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The chosen recorded round (the last by default), every party's tensors checked as vanilla
    records are (names, dtypes, shapes, one length per party, finite, labels in range)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from splitlab.audit.records import chosen_round, record_problem

    chosen = chosen_round(path, files, rnd)
    if chosen is None:
        return None
    file = files[chosen]
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError) as error:
        raise UserError(f"cannot read {str(file)!r}: {str(error).splitlines()[0][:160]}") from None
    plan = model.plan
    for name in tensors:
        match = _PARTY_TENSOR.fullmatch(name)
        if match is None or int(match[2]) >= plan.parties:
            raise UserError(
                f"{str(file)!r} is not a record of this run: tensor {name!r}, expected inputs@j, smashed@j, "
                f"labels@j (and cut_grad@j) for parties j from 0 to {plan.parties - 1}"
            )
    for j in range(plan.parties):
        mine = {n.partition("@")[0]: t for n, t in tensors.items() if n.endswith(f"@{j}")}
        shapes = {"inputs": plan.party_shape(j), "smashed": tuple(model.shapes[j]), "labels": ()}
        problem = record_problem(mine, shapes, num_classes)
        if problem:
            raise UserError(f"{str(file)!r} is not a record of this run: party {j}'s {problem}")
    return chosen, tensors
