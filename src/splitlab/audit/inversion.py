"""Input reconstruction (`attack=inversion`; the learning-based model inversion of He et al. 2019,
"Model inversion attacks against collaborative inference"): the server trains a decoder from
smashed data back to inputs on auxiliary data it holds, then applies it to the smashed data it
received. Assumed: the server holds auxiliary samples from the clients' distribution (here: the
dataset's test split, disjoint from every client's training samples) and the client part's
weights (the final global client part of the run: in split federated learning the sync server
averages it, and a training server that is, or colludes with, the sync server has it), and it
knows the defense configuration, which it applies to its auxiliary data (Kerckhoffs). Scored by
SSIM and PSNR (torchmetrics) against the true inputs, which only the experimenter has; a table's
rows by R^2 per column and MSE, without a picture. On a vertical run, per party: the server (or a
label-holding party, which sees no more) inverts party j's embedding back to party j's features.
Against noise drawn afresh on each release (`noise:S`, `dp:epsilon=E`), a recorded run is also
attacked with each sample's releases over the recorded rounds averaged (`averaged`: n releases cut
the noise's standard deviation by sqrt(n)), reported beside the single release.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import Attack, Target, VerticalTarget
from splitlab.audit.common import DECODER_WIDTH, fit, image_scores, write_picture
from splitlab.audit.records import load_record, sample_keys
from splitlab.errors import UserError
from splitlab.privacy.defenses import Defense, received


class Inversion(Attack):
    name = "inversion"
    inputs = ("images", "table rows")
    why = "it reconstructs images; on a language run use attack=token_inversion"
    vertical = "each party's features from its embedding"

    def run(self, target: Target) -> dict[str, Any]:
        settings = target.settings
        x, smashed = target.observed()
        try:
            scores = inversion(target.client, target.defense, target.aux_x, smashed, x, settings.epochs, settings.seed)
        except ValueError as error:
            raise UserError(f"cannot attack {str(target.path)!r}: {error}") from None
        reconstructed = scores.pop("reconstructed")
        if x.dim() == 4:  # images; a table's rows have no picture
            write_picture(target.path / "attack_inversion.png", x[:16].cpu(), reconstructed)
        if target.recorded and target.defense.noise > 0:
            scores["averaged"] = averaged_inversion(target, x)
        return scores

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        """Per party on a vertical run: images SSIM / PSNR, table rows mean R^2 per column / MSE, with the floor."""
        rows = []
        if "averaged" in result:
            averaged = result["averaged"]
            rows.append(
                (
                    f"averaged over {averaged['releases_mean']:.1f} releases a sample "
                    f"(decoder for {averaged['releases']}; {averaged['attacker']})",
                    _said(averaged),
                )
            )
        for party, scores in result.get("by_party", {None: result}).items():
            who = "" if party is None else f"party {party}: "
            measure, floor = ("SSIM / PSNR", "mean image") if "ssim" in scores else ("R^2 per column / MSE", "mean row")
            rows += [
                (f"{who}{measure} ({scores['attacker']})", _said(scores)),
                (f"{who}decoder", _said(scores["decoder"])),
                (f"{who}floor: {floor}", _said(scores["baseline"])),
            ]
        return rows

    def run_vertical(self, target: VerticalTarget) -> dict[str, Any]:
        plan, settings, by_party = target.plan, target.settings, {}
        try:
            for j, bottom in enumerate(target.model.bottoms):
                if target.recorded is None:
                    inputs = plan.columns(target.x, j)
                    smashed = received(bottom, inputs, target.defense, settings.seed)
                else:
                    inputs, smashed = target.recorded[1][f"inputs@{j}"], target.recorded[1][f"smashed@{j}"]
                scores = inversion(
                    bottom,
                    target.defense,
                    plan.columns(target.aux_x, j),
                    smashed,
                    inputs,
                    settings.epochs,
                    settings.seed,
                )
                scores.pop("reconstructed")
                by_party[j] = {"columns": list(plan.groups[j]), **scores}
        except ValueError as error:
            raise UserError(f"cannot attack {str(target.path)!r}: {error}") from None
        first = by_party[0]
        return {**{k: v for k, v in first.items() if k in ("scored", "samples")}, "by_party": by_party}


def averaged_inversion(target: Target, inputs: torch.Tensor) -> dict[str, Any]:
    """Against noise on each release (`noise:S`, `dp:epsilon=E`): the attacked round's samples,
    each as the mean of its releases in every recorded round (n releases: the noise's standard
    deviation over sqrt(n)), decoded by a decoder trained on auxiliary data averaged over the
    median n of the server's own draws. The server knows the run's seed, hence each client's batch
    order, hence which release is which sample; the record links them by their recorded inputs."""
    sums: dict[bytes, torch.Tensor] = {}
    counts: dict[bytes, int] = {}
    num_classes = target.experiment.blueprint.num_classes
    for file in target.recorded_rounds.values():
        tensors = load_record(file, target.shapes, num_classes)
        for key, smashed in zip(sample_keys(tensors["inputs"]), tensors["smashed"]):
            sums[key] = sums[key] + smashed if key in sums else smashed.clone()
            counts[key] = counts.get(key, 0) + 1
    keys = sample_keys(inputs)
    averaged = torch.stack([sums[key] / counts[key] for key in keys]).to(inputs.device)
    releases = [counts[key] for key in keys]
    settings = target.settings
    scores = inversion(
        target.client,
        target.defense,
        target.aux_x,
        averaged,
        inputs,
        settings.epochs,
        settings.seed,
        releases=int(np.median(releases)),
    )
    scores.pop("reconstructed")
    return {**scores, "releases": int(np.median(releases)), "releases_mean": float(np.mean(releases))}


def train_decoder(smashed: torch.Tensor, inputs: torch.Tensor, epochs: int, seed: int) -> nn.Module:
    """An MLP from flattened smashed data to flattened inputs, fit by MSE on the server's auxiliary pairs."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        d_in, d_out = smashed[0].numel(), inputs[0].numel()
        decoder = nn.Sequential(
            nn.Flatten(),
            nn.Linear(d_in, DECODER_WIDTH),
            nn.ReLU(),
            nn.Linear(DECODER_WIDTH, DECODER_WIDTH),
            nn.ReLU(),
            nn.Linear(DECODER_WIDTH, d_out),
        ).to(smashed.device)
        return fit(decoder, smashed, inputs.flatten(1), F.mse_loss, epochs, 64)


def table_scores(reconstructed: torch.Tensor, target: torch.Tensor) -> dict[str, Any]:
    """Table rows (N, columns) rebuilt: the mean squared error, and each column's R^2 (1 - its
    squared error over its variance about its own mean: 1 exact, 0 no better than knowing that
    mean, negative worse) with their mean; a column constant over the targets has no R^2 (None)."""
    error = (reconstructed - target).double().pow(2)
    spread = (target - target.mean(0)).double().pow(2).sum(0)
    by_column = [None if float(s) == 0 else 1 - float(e) / float(s) for e, s in zip(error.sum(0), spread)]
    scored = [r for r in by_column if r is not None]
    return {"r2": float(np.mean(scored)) if scored else 0.0, "mse": float(error.mean()), "r2_by_column": by_column}


def inversion(
    client: nn.Module,
    defense: Defense,
    aux_inputs: torch.Tensor,
    target_smashed: torch.Tensor,
    target_inputs: torch.Tensor,
    epochs: int,
    seed: int,
    releases: int = 1,
) -> dict[str, Any]:
    """Train a decoder on the server's auxiliary data and reconstruct the target inputs from the
    smashed data the server received: images (N, C, H, W), scored by SSIM and PSNR, or table rows
    (N, columns), scored by R^2 per column and MSE (`table_scores`). The result is the stronger of
    the decoder and the trivial attacker that answers the auxiliary data's mean (the floor): under
    strong noise a decoder can do worse than that, which must not read as privacy. Both are reported.
    `releases`: the targets are means of that many releases, so the decoder trains on the mean of
    as many of the server's own draws per auxiliary sample."""
    if target_inputs.dim() not in (2, 4):
        raise ValueError(
            f"input reconstruction needs images (N, C, H, W) or table rows (N, columns), not inputs of shape "
            f"{tuple(target_inputs.shape)}"
        )
    draws = [received(client, aux_inputs, defense, seed + 1 + draw) for draw in range(releases)]
    aux_smashed = torch.stack(draws).mean(0) if releases > 1 else draws[0]
    decoder = train_decoder(aux_smashed, aux_inputs, epochs, seed)
    with torch.no_grad():
        reconstructed = torch.cat([decoder(z) for z in target_smashed.split(256)]).view_as(target_inputs)
    mean_input = aux_inputs.mean(0, keepdim=True).expand_as(target_inputs)
    if target_inputs.dim() == 4:
        data_range = float(target_inputs.max() - target_inputs.min())
        learned, floor = (image_scores(r, target_inputs, data_range) for r in (reconstructed, mean_input))
        key, mean_name = "ssim", "mean image"
    else:
        learned, floor = table_scores(reconstructed, target_inputs), table_scores(mean_input, target_inputs)
        key, mean_name = "r2", "mean row"
    best = "decoder" if learned[key] >= floor[key] else mean_name
    return {
        **(learned if best == "decoder" else floor),
        "attacker": best,  # the stronger of the two: a failed decoder never reads as privacy
        "decoder": learned,
        "baseline": floor,
        "samples": len(target_inputs),
        "aux_samples": len(aux_inputs),
        "reconstructed": (reconstructed if best == "decoder" else mean_input)[:16].cpu(),
    }


def _said(scores: dict[str, Any]) -> str:
    if "ssim" in scores:
        return f"{scores['ssim']:.3f} / {scores['psnr']:.2f} dB"
    return f"{scores['r2']:.3f} / {scores['mse']:.4f}"
