"""`splitlab attack` on a finished vertical run (setting=vertical): what the server learns of each
party's features and what a passive party learns of the labels.

- `inversion`, per party: the server (or a label-holding party, which sees no more) inverts party
  j's embedding back to party j's features (its region of an image, its columns of a table) with
  the learning-based inversion of vanilla runs (splitlab.audit.inversion, the same decoder and `fit`).
  Assumed, as there: the attacker holds auxiliary samples with party j's features (a seeded part
  of the test split, disjoint from the targets) and party j's final bottom model, and knows the
  defense. Scored per party: SSIM/PSNR for image regions, per-column R^2 and MSE for table
  columns, each against the floor of answering the auxiliary data's mean.
- `label_leak`: every passive party (one without the labels) scores the labels from the gradients
  it receives at its embedding (Li et al. 2022's norm and direction attacks, splitlab.audit.label_leak).

Targets are what the server saw in a recorded round when the run was made with `record=N` (the
last by default, `round=` another; splitlab.privacy.record.PartyRecorder), otherwise held-out test
samples through the final model, with the run's defense applied. This module builds that target
(`vertical_target`); each attack plays on it in its own module (`Attack.run_vertical`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splitlab.audit.attack import VerticalTarget
from splitlab.audit.records import attack_sizes, chosen_round, record_files, record_problem
from splitlab.codec import read_tensors
from splitlab.errors import UserError

if TYPE_CHECKING:
    from splitlab.audit.attack import Attack
    from splitlab.audit.settings import AttackSettings

_PARTY_TENSOR = re.compile(r"(inputs|smashed|labels|cut_grad)@(\d+)")


def vertical_target(
    path: Path, stored: dict[str, Any], settings: AttackSettings, attack: type[Attack]
) -> VerticalTarget:
    """The target of `attack` on the vertical run in `path`; refused in one line where the run
    cannot give what the attack needs."""
    from splitlab.assembly import test_set
    from splitlab.finished_run import check_columns_in_one_process
    from splitlab.settings.vertical import load_final

    if settings.client:
        raise UserError(f"client={settings.client} does not apply to a vertical run: every party is attacked")
    check_columns_in_one_process(
        stored,
        path,
        f"attack={attack.name}",
        beside=", beside the final model (or a round recorded there)",
        so=" and no round could be recorded, so nothing here can be attacked",
    )
    files = record_files(path)  # stray or misnamed files refused before any work
    config, vertical, model = load_final(path, stored, settings.device)
    plan, blueprint = vertical.plan, vertical.blueprint
    recorded = _recorded(path, files, settings.round, model, blueprint.num_classes)
    passive = [j for j in range(plan.parties) if j != plan.labels_at]
    x, y = test_set(config, vertical.data, blueprint.device)
    order = np.random.default_rng([settings.seed, len(y)]).permutation(len(y))
    if not attack.aux:  # held-out targets only
        held_out = min(500, len(y)) if settings.targets is None else settings.targets
        if held_out > len(y):
            raise UserError(f"targets={held_out} is more than the {len(y)} test samples of {str(path)!r}")
        aux = 0
    else:
        held_out, aux = attack_sizes(len(y), settings.aux, settings.targets, held_out=recorded is None)
    chosen = torch.as_tensor(order[:held_out], device=y.device)
    aux_x = x[torch.as_tensor(order[held_out : held_out + aux], device=y.device)]
    source = f"recorded round {recorded[0]}" if recorded else f"{held_out} held-out test samples, final model"
    return VerticalTarget(
        path, settings, config, plan, model, blueprint.defense, x[chosen], y[chosen], aux_x, recorded, passive, source
    )


def _recorded(
    path: Path, files: dict[int, Path], rnd: int | None, model: Any, num_classes: int
) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The chosen recorded round (the last by default), every party's tensors checked as vanilla
    records are (names, dtypes, shapes, one length per party, finite, labels in range)."""
    chosen = chosen_round(path, files, rnd)
    if chosen is None:
        return None
    file = files[chosen]
    tensors = read_tensors(file)
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
