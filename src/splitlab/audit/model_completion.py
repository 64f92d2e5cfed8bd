"""Label inference by model completion (Fu et al. 2022, "Label Inference Attacks Against Vertical
Federated Learning", USENIX Security, the passive attack).

The attacker is the party that holds the bottom model and not the labels: it takes its trained
client part, puts a fresh small top model (the "inference head") on it, fits the head on a few
samples whose labels it knows, and predicts the labels of the samples it wants. What the trained
client part learned from the labels (through the cut gradients) is what makes that work with few
labels. The paper fine-tunes the completed model semi-supervised (MixMatch, with the unlabelled
samples); here the client part is frozen and the head is fitted by plain supervised training on
the labelled samples alone: a weaker attacker, so a lower bound on what model completion gets.

The client computes its own features, so no defense at the cut applies to them (defenses protect
what leaves the client). Two references go with the result: the **floor**, the best constant
guess (the targets' most frequent class), and the same head fitted on the **untrained** client
part (the run's initial weights), which says how much of the accuracy training put there rather
than the architecture and the few labels alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import Attack, Target
from splitlab.audit.common import fit
from splitlab.errors import UserError
from splitlab.models import split

HEAD_WIDTH = 128
DEFAULT_PER_CLASS = 40  # labelled samples of each class the attacker holds by default
MIN_HEAD_STEPS = 300  # a few labels fill one batch: an epoch is one step, too few to fit the head
BATCH = 64


def balanced_labelled(labels: np.ndarray, aux: int | None, num_classes: int) -> np.ndarray:
    """Positions in `labels` (the auxiliary pool) of the attacker's labelled samples: the first
    aux / num_classes of each class, or by default DEFAULT_PER_CLASS each (fewer if a class of the
    pool has fewer, all classes alike). ValueError if `aux` is not a multiple of the classes or a
    class of the pool is too small."""
    if aux is None:
        per_class = min(DEFAULT_PER_CLASS, *(int((labels == c).sum()) for c in range(num_classes)))
    elif aux % num_classes:
        raise ValueError(
            f"aux={aux} is not a multiple of the {num_classes} classes: model completion takes the same "
            "number of labelled samples of each class"
        )
    else:
        per_class = aux // num_classes
    if per_class < 1:
        raise ValueError("the auxiliary samples lack a class: model completion needs a labelled sample of each")
    chosen = []
    for c in range(num_classes):
        own = np.flatnonzero(labels == c)[:per_class]
        if len(own) < per_class:
            raise ValueError(f"the auxiliary pool holds {len(own)} samples of class {c}, fewer than {per_class}")
        chosen.append(own)
    return np.sort(np.concatenate(chosen))


def features(client: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The client part's outputs for `x`, flattened (the attacker runs its own part: no defense)."""
    with torch.no_grad():
        return torch.cat([client(b).flatten(1) for b in x.split(256)])


def fit_head(inputs: torch.Tensor, labels: torch.Tensor, num_classes: int, epochs: int, seed: int) -> nn.Module:
    """The inference head (an MLP with one hidden layer of HEAD_WIDTH), fitted by cross-entropy on
    the labelled features, centred by their mean and scaled by their overall spread (one scale:
    per-feature scales from a few samples would blow up features that happen to be constant
    there); `epochs` passes, at least MIN_HEAD_STEPS steps in all."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mean = inputs.mean(0)
        scale = (inputs - mean).std().clamp_min(1e-12)
        head = nn.Sequential(nn.Linear(inputs.shape[1], HEAD_WIDTH), nn.ReLU(), nn.Linear(HEAD_WIDTH, num_classes)).to(
            inputs.device
        )
        passes = max(epochs, math.ceil(MIN_HEAD_STEPS / math.ceil(len(inputs) / BATCH)))
        fit(head, (inputs - mean) / scale, labels, F.cross_entropy, passes, BATCH, weight_decay=1e-4)
    return nn.Sequential(_Standardise(mean, scale), head).eval()


class _Standardise(nn.Module):
    def __init__(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.mean, self.scale = mean, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.scale


def model_completion(
    client: nn.Module,
    untrained_client: nn.Module,
    aux_x: torch.Tensor,
    aux_y: torch.Tensor,
    target_x: torch.Tensor,
    target_y: torch.Tensor,
    num_classes: int,
    epochs: int,
    seed: int,
) -> dict[str, Any]:
    """Label-inference accuracy of the completed trained client part on the targets, with the
    floor (best constant guess) and the untrained client part completed the same way."""

    def completed_accuracy(part: nn.Module) -> float:
        """Accuracy on the targets of `part` completed with a head fitted on (aux_x, aux_y)."""
        head = fit_head(features(part, aux_x), aux_y, num_classes, epochs, seed)
        with torch.no_grad():
            predicted = head(features(part, target_x)).argmax(1)
        return float((predicted == target_y).float().mean())

    counts = torch.bincount(target_y, minlength=num_classes)
    return {
        "accuracy": completed_accuracy(client),
        "untrained_accuracy": completed_accuracy(untrained_client),
        "floor": float(counts.max()) / len(target_y),
        "floor_class": int(counts.argmax()),
        "labelled": len(aux_y),
        "labelled_per_class": len(aux_y) // num_classes,
        "samples": len(target_y),
    }


class ModelCompletion(Attack):
    name = "model_completion"
    inputs = ("images", "table rows")
    why = "a language run's labels are its next input tokens, which the client holds"

    def run(self, target: Target) -> dict[str, Any]:
        """Labelled samples drawn from the test samples that are not targets, against the trained
        client part and the untrained one (the run's initial weights)."""
        x, y, settings, experiment = target.x, target.y, target.settings, target.experiment
        if target.recorded:
            x, y = (target.recorded[1][name].to(x.device) for name in ("inputs", "labels"))
        data, num_classes = experiment.data, experiment.blueprint.num_classes
        pool = target.order[target.held_out :]
        try:
            labelled = pool[balanced_labelled(data.test_y[pool].cpu().numpy(), settings.aux, num_classes)]
        except ValueError as error:
            raise UserError(f"cannot attack {str(target.path)!r}: {error}") from None
        untrained, _ = split(experiment.blueprint.new_model(), experiment.config.run.cut)
        labelled_idx = torch.as_tensor(labelled, device=data.test_y.device)
        return model_completion(
            target.client,
            untrained.eval(),
            data.test_x[labelled_idx],
            data.test_y[labelled_idx],
            x,
            y,
            num_classes,
            settings.epochs,
            settings.seed,
        )

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        return [
            (f"label accuracy ({result['labelled']} labelled)", f"{result['accuracy']:.2%}"),
            ("untrained client part, same head", f"{result['untrained_accuracy']:.2%}"),
            (f"floor: always class {result['floor_class']}", f"{result['floor']:.2%}"),
        ]
