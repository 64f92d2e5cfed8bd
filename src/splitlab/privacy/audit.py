"""`splitlab attack RUN attack=inversion|label_leak`: the curious server's attacks on a finished run.

Targets are what the server saw during training when the run was made with `record=N` (the last
recorded round by default, `round=` another), otherwise what it would see from the final model:
held-out test samples through the final client part, with the run's defense applied. The
server's auxiliary data is a seeded part of the test split, disjoint from those held-out samples.
Results go to RUN/attack.json (one entry per attack) and, for inversion, RUN/attack_inversion.png.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from splitlab import rundir
from splitlab.algorithms import get_algorithm
from splitlab.config import RunConfig
from splitlab.errors import UserError
from splitlab.io import write_json, write_png
from splitlab.privacy import attacks
from splitlab.privacy.record import RECORD_DIR

RESULTS = "attack.json"
PICTURE = "attack_inversion.png"


class AttackSettings(BaseModel):
    """The `splitlab attack` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    attack: Literal["inversion", "label_leak"]
    round: int | None = Field(None, ge=0, description="recorded round to attack (default: the last one recorded)")
    aux: int | None = Field(
        None, ge=10, description="auxiliary samples the server holds, from the test split (default: 2000 or what fits)"
    )
    targets: int | None = Field(
        None,
        ge=10,
        description="held-out samples attacked when nothing was recorded (default: 500 or half the test split)",
    )
    epochs: int = Field(30, ge=1, description="decoder training epochs (inversion)")
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    seed: int = Field(0, ge=0)


def attack_run(run_dir: str | Path, raw: dict) -> dict[str, Any]:
    """Run one attack on a finished run; returns its result, also merged into RUN/attack.json."""
    from splitlab.splitgp import parse_settings
    from splitlab.splitgp.evaluation import global_states, load_run

    settings = parse_settings(AttackSettings, raw)
    path = Path(run_dir)
    algorithm = rundir.stored_config(path, "attack", "point attack at a finished run's directory").get("algorithm")
    if get_algorithm(algorithm or RunConfig().algorithm).personal_models:
        raise UserError(
            f"{str(path)!r} is a {algorithm} run: its clients keep personal client parts, "
            f"and attack needs a run with one global split model (weights.safetensors)"
        )
    experiment = load_run(path, settings.device)
    states = global_states(experiment)
    if len(states) != 2:
        raise UserError(f"{str(path)!r} is a {experiment.config.run.algorithm} run: nothing is split, no cut to attack")
    client, server = typing.cast(nn.Sequential, experiment.assemble(states))
    defense, data = experiment.blueprint.defense, experiment.data
    recorded = _recorded(path, settings.round)
    order = np.random.default_rng([settings.seed, len(data.test_y)]).permutation(len(data.test_y))
    held_out, aux = attack_sizes(len(order), settings.aux, settings.targets, held_out=recorded is None)
    aux_idx = torch.as_tensor(order[held_out : held_out + aux], device=data.test_y.device)
    target_idx = torch.as_tensor(order[:held_out], device=data.test_y.device)
    x, y = data.test_x[target_idx], data.test_y[target_idx]
    source = f"recorded round {recorded[0]}" if recorded else f"{held_out} held-out test samples, final model"
    result: dict[str, Any] = {"attack": settings.attack, "targets": source, "defense": experiment.config.run.defense}
    if settings.attack == "label_leak":
        if recorded:
            by_round = {r: _load(path, r) for r in _recorded_rounds(path)}
            result["by_round"] = {
                r: attacks.label_leak(t["cut_grad"], t["labels"]) for r, t in by_round.items() if "cut_grad" in t
            }
            if recorded[0] not in result["by_round"]:
                raise UserError(f"{experiment.config.run.algorithm} sends no cut gradients: no labels to infer")
            result.update(result["by_round"][recorded[0]])
        else:
            batch = experiment.config.run.batch_size
            result.update(
                attacks.label_leak(attacks.cut_gradients(client, server, x, y, defense, batch, settings.seed), y)
            )
    else:
        if recorded:
            _, tensors = recorded
            x, smashed = tensors["inputs"].to(data.test_x.device), tensors["smashed"].to(data.test_x.device)
        else:
            smashed = attacks.defended_smashed(client, x, defense, settings.seed)
        try:
            scores = attacks.inversion(
                client, defense, data.test_x[aux_idx], smashed, x, settings.epochs, settings.seed
            )
        except ValueError as error:
            raise UserError(f"cannot attack {str(path)!r}: {error}") from None
        _picture(path / PICTURE, x[:16].cpu(), scores.pop("reconstructed"))
        result.update(scores)
    results = json.loads((path / RESULTS).read_text()) if (path / RESULTS).is_file() else {}
    write_json(path / RESULTS, {**results, settings.attack: {"settings": settings.model_dump(), **result}})
    return result


def attack_sizes(
    available: int, aux: int | None, targets: int | None, held_out: bool, defaults: tuple[int, int] = (2000, 500)
) -> tuple[int, int]:
    """(held-out targets, auxiliary samples) out of `available` test samples: the given sizes, or
    refused if they do not fit (never shrunk silently); a size not given takes its default (aux,
    targets) or, if that does not fit, what does (half the split for targets, the rest for aux)."""
    if not held_out:  # the targets are the recorded samples
        chosen_targets = 0
    else:
        chosen_targets = targets if targets is not None else min(defaults[1], available // 2)
    chosen_aux = aux if aux is not None else min(defaults[0], available - chosen_targets)
    if chosen_targets + chosen_aux > available or chosen_aux < 10:
        raise UserError(
            f"aux={chosen_aux} and targets={chosen_targets} need {chosen_targets + chosen_aux} test samples; "
            f"the run's test split holds {available}: ask for fewer (aux + targets <= {available})"
        )
    return chosen_targets, chosen_aux


def _recorded_rounds(path: Path) -> list[int]:
    return sorted(int(f.stem.removeprefix("round_")) for f in (path / RECORD_DIR).glob("round_*.safetensors"))


def _load(path: Path, rnd: int) -> dict[str, torch.Tensor]:
    file = path / RECORD_DIR / f"round_{rnd:04d}.safetensors"
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError) as error:
        raise UserError(f"cannot read {str(file)!r}: {error}") from None
    n = len(tensors.get("labels", ()))
    if {"inputs", "smashed", "labels"} - set(tensors) or any(len(t) != n for t in tensors.values()):
        raise UserError(f"{str(file)!r} is not a splitlab record (inputs, smashed, labels of one length)")
    return tensors


def _recorded(path: Path, rnd: int | None) -> tuple[int, dict[str, torch.Tensor]] | None:
    rounds = _recorded_rounds(path)
    if rnd is not None and rnd not in rounds:
        have = f"recorded rounds: {rounds}" if rounds else "the run recorded nothing (run it with record=N)"
        raise UserError(f"round {rnd} was not recorded in {str(path)!r}; {have}")
    if not rounds:
        return None
    chosen = rounds[-1] if rnd is None else rnd
    return chosen, _load(path, chosen)


def _picture(file: Path, originals: torch.Tensor, reconstructed: torch.Tensor) -> None:
    """Originals (top row) over their reconstructions (bottom row), first channel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(originals)
    fig, axes = plt.subplots(2, n, figsize=(n * 0.8, 1.8), squeeze=False)
    for row, images in enumerate((originals, reconstructed)):
        for ax, image in zip(axes[row], images):
            ax.imshow(image[0].numpy(), cmap="gray")
            ax.axis("off")
    write_png(file, fig)
    plt.close(fig)
