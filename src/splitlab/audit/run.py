"""`splitlab attack RUN attack=...`: attacks on a finished run (the curious server's, a malicious
server's, and model completion).

Targets are what the server saw during training when the run was made with `record=N` (the last
recorded round by default, `round=` another), otherwise what it would see from the final model:
held-out test samples through the final client part, with the run's defense applied. The
server's auxiliary data is a seeded part of the test split, disjoint from those held-out samples.
Results go to RUN/attack.json (one entry per attack) and, for the reconstructions, RUN/attack_<attack>.png.
Image runs take `inversion`, `unsplit`, `fsha`, `label_leak` and `model_completion`
(splitlab.audit.model_completion),
language runs `token_inversion` (splitlab.audit.token_inversion); each is refused in one line on the other.
`inversion` of a table's rows (breast_cancer, csv) is scored by R^2 per column and MSE, without a
picture. Vertical runs take `inversion` per party and `label_leak` (splitlab.audit.vertical).
`fsha` is different: an active attack during training, simulated afresh on the run's configuration
and data (splitlab.audit.fsha), not played on what the run recorded.
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
from splitlab.audit import attacks, fsha, unsplit
from splitlab.audit import model_completion as completion
from splitlab.audit import token_inversion as tokens
from splitlab.audit.records import attack_sizes, chosen_round, record_files, record_problem
from splitlab.config import UNSPLIT_ALGORITHMS, RunConfig
from splitlab.errors import UserError
from splitlab.io import write_json, write_png
from splitlab.models import HeadAndTail, output_shape, split
from splitlab.roles import client_part, server_part

if typing.TYPE_CHECKING:
    from splitlab.assembly import Experiment

RESULTS = "attack.json"


class AttackSettings(BaseModel):
    """The `splitlab attack` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    attack: Literal["inversion", "label_leak", "unsplit", "fsha", "model_completion", "token_inversion"]
    round: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="recorded round to attack, numbered from 1 as in metrics.jsonl (default: the last)",
    )
    client: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="with personal client parts (psl, sglr, ...): the client whose model is attacked",
    )
    aux: int | None = Field(
        None,
        ge=10,
        le=10_000_000,
        description="auxiliary samples the attacker holds, from the test split (default: 2000 or what fits; "
        "model_completion: labelled samples, the same number of each class, default 40 of each or what fits)",
    )
    targets: int | None = Field(
        None,
        ge=10,
        le=10_000_000,
        description="held-out samples attacked when nothing was recorded (default: 500 or half the test split)",
    )
    epochs: int = Field(
        30, ge=1, le=100_000, description="training epochs of the decoder (inversions) or head (model_completion)"
    )
    iterations: int = Field(30, ge=1, le=100_000, description="alternations of input and surrogate descent (unsplit)")
    tv: float = Field(0.001, ge=0, le=1_000, description="weight of the total-variation prior (unsplit)")
    steps: int = Field(300, ge=10, le=10_000_000, description="client training steps under attack (fsha)")
    guard: int = Field(5, ge=2, le=10_000, description="SplitGuard: a fake batch every this many steps (fsha)")
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    seed: int = Field(0, ge=0, le=2**32 - 1)


def attack_run(run_dir: str | Path, raw: dict) -> dict[str, Any]:
    """Run one attack on a finished run; returns its result, also merged into RUN/attack.json."""
    from splitlab.config import parse_settings
    from splitlab.finished_run import final_states, load_run

    settings = parse_settings(AttackSettings, raw)
    path = Path(run_dir)
    stored = rundir.stored_config(path, "attack", "point attack at a finished run's directory")
    if stored.get("setting") == "vertical":  # parties holding features: splitlab.audit.vertical
        from splitlab.audit.vertical import attack_vertical

        found = attack_vertical(path, stored, settings)
        earlier = json.loads((path / RESULTS).read_text()) if (path / RESULTS).is_file() else {}
        write_json(path / RESULTS, {**earlier, settings.attack: {"settings": settings.model_dump(), **found}})
        return found
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
    defense, data = experiment.blueprint.defense, experiment.data
    _check_task(settings.attack, data.task, path)
    client, server = typing.cast(nn.Sequential, experiment.assemble(final_states(experiment, settings.client)))
    shapes = {
        "inputs": tuple(data.test_x.shape[1:]),
        "smashed": output_shape(client, tuple(data.test_x.shape[1:]), data.test_x.dtype),
        "labels": tuple(data.test_y.shape[1:]),  # a language task's targets: one per position
    }
    # what the server infers labels from: the cut gradient it sends, or U-shaped the gradient it receives at B
    gradient = "tail_grad" if isinstance(client, HeadAndTail) else "cut_grad"
    if gradient == "tail_grad":
        shapes["tail_grad"] = output_shape(nn.Sequential(client, server), shapes["inputs"])
    recorded = _recorded(path, recorded_rounds, settings.round, shapes, experiment.blueprint.num_classes)
    order = np.random.default_rng([settings.seed, len(data.test_y)]).permutation(len(data.test_y))
    held_out, aux = attack_sizes(
        len(order), settings.aux, settings.targets, held_out=recorded is None or settings.attack == "fsha"
    )
    aux_idx = torch.as_tensor(order[held_out : held_out + aux], device=data.test_y.device)
    target_idx = torch.as_tensor(order[:held_out], device=data.test_y.device)
    x, y = data.test_x[target_idx], data.test_y[target_idx]
    source = f"recorded round {recorded[0]}" if recorded else f"{held_out} held-out test samples, final model"
    if settings.attack == "fsha":
        source = f"client {settings.client}'s training samples, {settings.steps} simulated steps"
    result: dict[str, Any] = {"attack": settings.attack, "targets": source, "defense": experiment.config.run.defense}
    if settings.attack == "label_leak":
        result["gradient"] = gradient
    if settings.attack == "model_completion":
        if recorded:
            x, y = recorded[1]["inputs"].to(x.device), recorded[1]["labels"].to(x.device)
        result.update(_model_completion(experiment, client, order[held_out:], x, y, settings, path))
    elif settings.attack == "token_inversion":
        if recorded:
            x, smashed = recorded[1]["inputs"].to(x.device).long(), recorded[1]["smashed"].to(x.device)
        else:
            smashed = attacks.defended_smashed(client, x, defense, settings.seed)
        result.update(
            tokens.token_inversion(
                client,
                defense,
                data.test_x[aux_idx],
                smashed,
                x,
                experiment.blueprint.num_classes,
                settings.epochs,
                settings.seed,
                data.vocabulary,
            )
        )
    elif settings.attack == "label_leak":
        if recorded:
            by_round = {r: _load(file, shapes, experiment.blueprint.num_classes) for r, file in recorded_rounds.items()}
            result["by_round"] = {
                r: attacks.label_leak(t[gradient], t["labels"]) for r, t in by_round.items() if gradient in t
            }
            if recorded[0] not in result["by_round"]:
                raise UserError(f"{experiment.config.run.algorithm} sends no cut gradients: no labels to infer")
            result.update(result["by_round"][recorded[0]])
        else:
            batch = experiment.config.run.batch_size
            if isinstance(client, HeadAndTail):
                grads = attacks.tail_gradients(client, server, x, y, defense, batch, settings.seed)
            else:
                grads = attacks.cut_gradients(client, server, x, y, defense, batch, settings.seed)
            result.update(attacks.label_leak(grads, y))
    elif settings.attack == "fsha":
        warmup = settings.steps // 5  # SplitGuard starts once training has settled a little
        if (settings.steps - warmup) // settings.guard < 1:
            raise UserError(
                f"guard={settings.guard} leaves SplitGuard no fake batch and regular ones to compare in "
                f"steps={settings.steps} (the first {warmup} are warm-up); allowed: 2 to {(settings.steps - warmup)}"
            )
        assert experiment.roles is not None  # load_run builds every role in this process
        node = experiment.roles.clients[settings.client]
        blueprint = experiment.blueprint
        setup = fsha.Simulation(
            client=client_part(blueprint),
            server=server_part(blueprint),
            make_optimizer=blueprint.optimizer,
            defense=defense,
            private_x=node.inputs(node.x),
            private_y=node.y,
            aux_x=data.test_x[aux_idx],
            test_x=x,
            test_y=y,
            num_classes=blueprint.num_classes,
            batch_size=experiment.config.run.batch_size,
        )
        if setup.private_x.dim() != 4:
            raise UserError(
                f"cannot attack {str(path)!r}: FSHA reconstructs images, not inputs of shape "
                f"{tuple(setup.private_x.shape[1:])}"
            )
        result["malicious"] = fsha.simulate(setup, True, settings.steps, 5, warmup, settings.guard, settings.seed)
        result["honest"] = fsha.simulate(setup, False, settings.steps, 5, warmup, settings.guard, settings.seed)
        _picture(path / "attack_fsha.png", setup.private_x[:16].cpu(), result["malicious"].pop("reconstructed"))
    else:
        if recorded:
            _, tensors = recorded
            x, smashed = tensors["inputs"].to(data.test_x.device), tensors["smashed"].to(data.test_x.device)
        else:
            smashed = attacks.defended_smashed(client, x, defense, settings.seed)
        try:
            if settings.attack == "unsplit":
                scores = unsplit.scored_unsplit(
                    client,
                    smashed,
                    x,
                    (float(data.test_x.min()), float(data.test_x.max())),  # the input format's range
                    data.test_x[aux_idx].mean(0, keepdim=True),
                    {"iterations": settings.iterations, "tv": settings.tv},
                    settings.seed,
                )
            else:
                scores = attacks.inversion(
                    client, defense, data.test_x[aux_idx], smashed, x, settings.epochs, settings.seed
                )
        except ValueError as error:
            raise UserError(f"cannot attack {str(path)!r}: {error}") from None
        reconstructed = scores.pop("reconstructed")
        if x.dim() == 4:  # images; a table's rows have no picture
            _picture(path / f"attack_{settings.attack}.png", x[:16].cpu(), reconstructed)
        result.update(scores)
    results = json.loads((path / RESULTS).read_text()) if (path / RESULTS).is_file() else {}
    write_json(path / RESULTS, {**results, settings.attack: {"settings": settings.model_dump(), **result}})
    return result


def check_classification(dataset: str, what: str) -> None:
    """Refuse, in one line, these attacks on a language dataset: they are image classification's."""
    from splitlab.data import SEQUENCE_DATASETS

    if dataset in SEQUENCE_DATASETS:
        raise UserError(
            f"{what} does not apply to dataset={dataset}: inversion rebuilds images (scored by SSIM/PSNR) and "
            f"label_leak infers class labels from cut gradients, but a language run's inputs are tokens, and its "
            f"targets (the text shifted by one token) already reach the server in the clear"
        )


LABELS_ARE_TOKENS = "a language run's labels are its next input tokens, which the client holds"
#: attack -> why it does not apply to a language run (the image attacks); token_inversion applies only there
NOT_FOR_LANGUAGE = {
    "inversion": "it reconstructs images; on a language run use attack=token_inversion",
    "label_leak": LABELS_ARE_TOKENS,
    "model_completion": LABELS_ARE_TOKENS,
}


def _check_task(attack: str, task: str, path: Path) -> None:
    if (attack == "token_inversion") == (task == "language"):
        return
    why = (
        "it reconstructs the tokens of a language run; use attack=inversion"
        if attack == "token_inversion"
        else NOT_FOR_LANGUAGE.get(attack, "it attacks image classification runs")
    )
    raise UserError(f"attack={attack} does not apply to {str(path)!r}, a {task} run: {why}")


def _model_completion(
    experiment: Experiment,
    client: nn.Module,
    pool: np.ndarray,
    target_x: torch.Tensor,
    target_y: torch.Tensor,
    settings: AttackSettings,
    path: Path,
) -> dict[str, Any]:
    """Model completion with labelled samples drawn from the test samples in `pool` (not targets),
    against the trained client part and the untrained one (the run's initial weights)."""
    data, num_classes = experiment.data, experiment.blueprint.num_classes
    try:
        labelled = pool[completion.balanced_labelled(data.test_y[pool].cpu().numpy(), settings.aux, num_classes)]
    except ValueError as error:
        raise UserError(f"cannot attack {str(path)!r}: {error}") from None
    untrained, _ = split(experiment.blueprint.new_model(), experiment.config.run.cut)
    labelled_idx = torch.as_tensor(labelled, device=data.test_y.device)
    return completion.model_completion(
        client,
        untrained.eval(),
        data.test_x[labelled_idx],
        data.test_y[labelled_idx],
        target_x,
        target_y,
        num_classes,
        settings.epochs,
        settings.seed,
    )


def _load(file: Path, shapes: dict[str, tuple[int, ...]], num_classes: int) -> dict[str, torch.Tensor]:
    """A recorded round, every tensor checked: names, dtypes, shapes, one length, finite, labels in range."""
    try:
        tensors = load_file(file)
    except (OSError, SafetensorError) as error:
        raise UserError(f"cannot read {str(file)!r}: {str(error).splitlines()[0][:160]}") from None
    problem = record_problem(tensors, shapes, num_classes)
    if problem:
        raise UserError(f"{str(file)!r} is not a record of this run: {problem}")
    return tensors


def _recorded(
    path: Path, files: dict[int, Path], rnd: int | None, shapes: dict[str, tuple[int, ...]], num_classes: int
) -> tuple[int, dict[str, torch.Tensor]] | None:
    chosen = chosen_round(path, files, rnd)
    return None if chosen is None else (chosen, _load(files[chosen], shapes, num_classes))


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
