"""Label inference from gradients (`attack=label_leak`; Li et al. 2022, "Label Leakage and
Protection in Two-party Split Learning"): the norm attack scores each sample by its gradient's
norm, the direction attack by its gradient's cosine similarity to the gradient of one sample of
known label per class. Reported as ROC AUCs (scikit-learn; see `label_leak`): 0.5 is chance, 1.0
perfect separation; pooled over the recorded samples and, on a binary task, per batch (the
median and 95% quantile over the batches, the paper's figure). In a vanilla split the labels
travel with the smashed data, so the figure measures what the gradient channel alone reveals (to
an observer of the downlink), not a secret the server lacks; in a U-shaped split (`cut=A,B`) the
labels stay with the client, and the attack scores the gradients at the second cut the server
receives from the client's tail. On a vertical run, every passive party (one without the labels)
scores the labels from the gradients it receives at its embedding (pooled only). On a binary
task the attacks that know the defense (splitlab.audit.label_clusters: `cluster`, `residual`
against Marvell, `linked` against label DP) are reported beside Li et al.'s; `figures` declares
them all, so attack.json's `strongest` names the highest pooled AUC and the highest per-batch
median and the attack that reached each (splitlab.audit.run).
"""

from __future__ import annotations

import typing
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit import label_clusters
from splitlab.audit.attack import Attack, Target, VerticalTarget
from splitlab.audit.label_clusters import auc as roc_auc
from splitlab.audit.records import load_record
from splitlab.errors import UserError
from splitlab.models import HeadAndTail
from splitlab.privacy.defenses import Defense, decode, received
from splitlab.targets import IGNORED

LABELS_ARE_TOKENS = "a language run's labels are its next input tokens, which the client holds"
NO_GRADIENTS = "no cut gradient carries the labels, no labels to infer"
#: every attack scored per batch on a binary task: Li et al.'s two, then splitlab.audit.label_clusters'
PER_BATCH = ("norm", "direction", *label_clusters.ATTACKS)
#: what each defense-aware attack is, in the report's rows
ABOUT = {
    "cluster": "label-free clustering per batch, Liu et al. 2024",
    "residual": "label-free, per batch, against Marvell",
    "linked": "cluster scores averaged over each sample's releases, against label DP",
}


class LabelLeak(Attack):
    name = "label_leak"
    inputs = ("images", "table rows")
    why = LABELS_ARE_TOKENS
    vertical = "the labels from the gradients a passive party receives"
    aux = False
    figures = {
        **{f"{name}_auc": "label AUC" for name in PER_BATCH},
        "linked.auc": "label AUC",
        **{f"per_batch.{name}_auc_median": "per-batch label AUC (median)" for name in PER_BATCH},
    }

    def run(self, target: Target) -> dict[str, Any]:
        result: dict[str, Any] = {"gradient": target.gradient}
        experiment = target.experiment
        num_classes = experiment.blueprint.num_classes
        binary = num_classes == 2
        majority = bool((experiment.data.test_y == 1).double().mean() >= 0.5)  # the attacker's prior
        algorithm = experiment.config.run.algorithm
        params = experiment.config.params
        if experiment.config.algorithm_class.Server.cut_gradient_weight(params) == 0:
            given = ", ".join(f"{key}={value}" for key, value in params.model_dump().items())
            raise UserError(
                f"{algorithm} with {given} weights the server's loss 0, so its cut gradients are zero: {NO_GRADIENTS}"
            )
        if target.recorded:
            by_round = {r: load_record(f, target.shapes, num_classes) for r, f in target.recorded_rounds.items()}
            with_grads = {r: t for r, t in by_round.items() if target.gradient in t}
            if target.recorded[0] not in with_grads:
                raise UserError(f"{algorithm} sends no cut gradients: {NO_GRADIENTS}")
            if not any(bool(t[target.gradient].any()) for t in with_grads.values()):
                raise UserError(f"every recorded {target.gradient} of {algorithm}'s run is zero: {NO_GRADIENTS}")
            scored = {r: t for r, t in with_grads.items() if binary and "batches" in t}  # per batch too
            leaks_by_round = {
                r: batch_leaks(t[target.gradient], t["labels"], t["batches"], majority) for r, t in scored.items()
            }
            result["by_round"] = {
                r: {
                    **label_leak(t[target.gradient], t["labels"]),
                    **(
                        {
                            **label_clusters.pooled(t[target.gradient], t["labels"], t["batches"], majority),
                            **per_batch([leaks_by_round[r]]),
                        }
                        if r in scored
                        else {}
                    ),
                }
                for r, t in with_grads.items()
            }
            leaks = list(leaks_by_round.values())  # over every recorded round, as the paper's figure is over training
            if binary:
                result["linked"] = label_clusters.linked(list(scored.values()), target.gradient, majority)
            result.update(result["by_round"][target.recorded[0]])
        else:
            batch, seed = experiment.config.run.batch_size, target.settings.seed
            if isinstance(target.client, HeadAndTail):
                grads = tail_gradients(target.client, target.server, target.x, target.y, target.defense, batch, seed)
            else:
                grads = cut_gradients(target.client, target.server, target.x, target.y, target.defense, batch, seed)
            batches = torch.arange(len(target.y)) // batch  # the gradients were computed a batch at a time
            leaks = [batch_leaks(grads, target.y, batches, majority)] if binary else []
            result.update(label_leak(grads, target.y))
            if binary:
                result.update(label_clusters.pooled(grads, target.y, batches, majority))
        result.update(per_batch(leaks))
        if target.defense.marvell is not None and "per_batch" in result:
            result["marvell"] = (
                "Marvell bounds the leak only under its model of the gradients (per batch, each class "
                "N(mean, one variance x I)); the residual attack reads where trained gradients depart from it: "
                f"per-batch AUC median {result['per_batch']['residual_auc_median']:.3f}"
            )
        return result

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        rows = [
            ("norm attack AUC", f"{result['norm_auc']:.3f} ({result['scored']})"),
            ("direction attack AUC", f"{result['direction_auc']:.3f}"),
        ]
        for name in label_clusters.ATTACKS:
            if result.get(f"{name}_auc") is not None:
                rows.append((f"{name} attack AUC ({ABOUT[name]})", f"{result[f'{name}_auc']:.3f}"))
        if result.get("linked", {}).get("auc") is not None:
            row = result["linked"]
            rows.append(
                (
                    f"linked attack AUC ({ABOUT['linked']})",
                    f"{row['auc']:.3f} ({row['samples']} samples, {row['releases_mean']:.1f} releases each)",
                )
            )
        if "per_batch" in result:
            row = result["per_batch"]
            rows.append(
                (
                    f"  per batch, {row['batches']} batches (median / 95% quantile)",
                    ", ".join(
                        f"{name} {row[f'{name}_auc_median']:.3f} / {row[f'{name}_auc_q95']:.3f}" for name in PER_BATCH
                    ),
                )
            )
        for rnd, row in result.get("by_round", {}).items():
            names = [name for name in ("norm", "direction", *label_clusters.ATTACKS) if f"{name}_auc" in row]
            rows.append(
                (f"  round {rnd} ({' / '.join(names)})", " / ".join(f"{row[f'{name}_auc']:.3f}" for name in names))
            )
        for party, row in result.get("by_party", {}).items():  # a vertical run: every passive party
            rows.append((f"  party {party} (norm / direction)", f"{row['norm_auc']:.3f} / {row['direction_auc']:.3f}"))
        if "marvell" in result:
            rows.append(("Marvell's guarantee", result["marvell"]))
        return rows

    def run_vertical(self, target: VerticalTarget) -> dict[str, Any]:
        passive, recorded, by_party = target.passive, target.recorded, {}
        if not passive:
            raise UserError(
                f"{str(target.path)!r} has one party and it holds the labels: no passive party to attack with"
            )
        try:
            grads = (
                None if recorded else party_gradients(target.model, target.x, target.y, target.config.run.batch_size)
            )
            for j in passive:
                if grads is not None:
                    by_party[j] = label_leak(grads[j], target.y)
                elif recorded is not None and f"cut_grad@{j}" in recorded[1]:
                    by_party[j] = label_leak(recorded[1][f"cut_grad@{j}"], recorded[1][f"labels@{j}"])
                else:
                    raise ValueError(f"round {recorded and recorded[0]} recorded no gradient for party {j}")
        except ValueError as error:
            raise UserError(f"cannot attack {str(target.path)!r}: {error}") from None
        parties = f"passive part{'y' if len(passive) == 1 else 'ies'} {', '.join(map(str, passive))}"
        first = by_party[passive[0]]
        summary = {k: v for k, v in first.items() if k in ("norm_auc", "direction_auc", "scored", "samples")}
        return {"targets": f"{target.source}, {parties}", **summary, "by_party": by_party}


def label_leak(cut_grad: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """Norm and direction attacks of Li et al. 2022 on per-sample cut gradients, as ROC AUCs.

    Binary tasks: as in the paper, AUC of the score for the positive class (the larger label):
    the gradient's norm, and its cosine to one known positive sample's gradient. Multi-class: the
    norm attack's best one-vs-rest separation (the class and side where the norm separates best:
    1.0 when some class has its own norm range; note that on few samples chance is above 0.5), and
    the direction attack's mean one-vs-rest AUC, one known sample per class."""
    from sklearn.metrics import roc_auc_score

    grads = cut_grad.detach().flatten(1).double().cpu()
    y = labels.cpu().numpy()
    norms = grads.norm(dim=1).numpy()
    unit = F.normalize(grads, dim=1)
    classes = [c for c in np.unique(y) if 2 <= (y == c).sum() < len(y)]  # a known sample and one more
    if not classes or (len(np.unique(y)) == 2 and np.unique(y)[-1] not in classes):
        raise ValueError("label inference needs two samples of one class and one of another")

    def direction(c: int) -> float:
        positive = y == c
        reference = int(np.flatnonzero(positive)[0])  # the one sample of class c the attacker knows
        others = np.arange(len(y)) != reference
        return float(roc_auc_score(positive[others], (unit @ unit[reference]).numpy()[others]))

    if len(np.unique(y)) == 2:
        positive_class = int(np.unique(y)[-1])
        result = {
            "norm_auc": float(roc_auc_score(y == positive_class, norms)),
            "direction_auc": direction(positive_class),
        }
        return {**result, "scored": f"AUC for the positive class {positive_class}", "samples": len(y)}
    separations = {int(c): float(roc_auc_score(y == c, norms)) for c in classes}
    best = max(separations, key=lambda c: max(separations[c], 1 - separations[c]))
    return {
        "norm_auc": max(separations[best], 1 - separations[best]),
        "direction_auc": float(np.mean([direction(c) for c in classes])),
        "scored": f"norm: best one-vs-rest separation (class {best}); direction: mean one-vs-rest AUC",
        "samples": len(y),
    }


def batch_leaks(
    cut_grad: torch.Tensor, labels: torch.Tensor, batches: torch.Tensor, majority: bool
) -> dict[str, list[float]]:
    """Each attack's AUC in each batch of a binary task (`PER_BATCH`), scored within the batch, the
    paper's way (its figures are quantiles of these over training): a batch counts if it was
    recorded whole (its number is not -1) and holds both classes and two positives (the direction
    attacker's known one, and one more to score)."""
    adaptive = label_clusters.scores(cut_grad, batches, majority)
    leaks: dict[str, list[float]] = {name: [] for name in PER_BATCH}
    for number in [n for n in torch.unique(batches).tolist() if n >= 0]:
        members = batches == number
        y = labels[members]
        if len(torch.unique(y)) == 2 and int((y == y.max()).sum()) >= 2:
            leak = label_leak(cut_grad[members], y)
            leaks["norm"].append(leak["norm_auc"])
            leaks["direction"].append(leak["direction_auc"])
            positive = (y == 1).cpu().numpy()
            for name in label_clusters.ATTACKS:
                leaks[name].append(typing.cast(float, roc_auc(positive, adaptive[name][members.cpu().numpy()])))
    return leaks


def per_batch(leaks: list[dict[str, list[float]]]) -> dict[str, Any]:
    """The median, the mean and the 95% quantile of each attack's per-batch AUCs over the given
    rounds' batches (nothing if no batch counted)."""
    aucs = {name: [a for leak in leaks for a in leak[name]] for name in PER_BATCH}
    if not aucs["norm"]:
        return {}
    found: dict[str, Any] = {"batches": len(aucs["norm"])}
    for name, values in aucs.items():
        found[f"{name}_auc_median"] = float(np.median(values))
        found[f"{name}_auc_mean"] = float(np.mean(values))
        found[f"{name}_auc_q95"] = float(np.quantile(values, 0.95))
    return {"per_batch": found}


def cut_gradients(
    client: nn.Module, server: nn.Module, x: torch.Tensor, y: torch.Tensor, defense: Defense, batch_size: int, seed: int
) -> torch.Tensor:
    """The cut gradients the server would send for (x, y) (mean loss over each batch), as decoded:
    computed from the labels as sent (with `label_dp:E`, randomised), as the server computes them."""
    grads = []
    smashed = received(client, x, defense, seed)
    generator = torch.Generator(x.device).manual_seed(seed + 2)
    for z, labels in zip(smashed.split(batch_size), y.split(batch_size)):
        z = z.detach().requires_grad_()
        logits = server(z)
        sent = defense.private_labels(labels, logits.shape[-1], generator)
        (grad,) = torch.autograd.grad(F.cross_entropy(logits, sent), z)
        grads.append(decode(defense.send_gradient(grad, generator, sent)))
    return torch.cat(grads)


def tail_gradients(
    client: HeadAndTail,
    server: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    defense: Defense,
    batch_size: int,
    seed: int,
) -> torch.Tensor:
    """U-shaped: the gradients at the second cut the client's tail would send the server for (x, y)
    (mean loss over each batch), the server's output computed from the defended smashed data."""
    with torch.no_grad():
        outputs = torch.cat([server(z) for z in received(client, x, defense, seed).split(256)])
    grads = []
    for output, labels in zip(outputs.split(batch_size), y.split(batch_size)):
        output = output.detach().requires_grad_()
        logits = client.tail(output).flatten(0, -2)  # a language run's: (B, T, V), a target per position
        (grad,) = torch.autograd.grad(F.cross_entropy(logits, labels.flatten(), ignore_index=IGNORED), output)
        grads.append(grad)
    return torch.cat(grads)


def party_gradients(model: Any, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
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
