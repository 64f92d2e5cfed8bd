"""Attacks by an honest-but-curious training server on what it receives at the cut.

- Input reconstruction (`inversion`; the learning-based model inversion of He et al. 2019, "Model
  inversion attacks against collaborative inference"): the server trains a decoder from smashed
  data back to inputs on auxiliary data it holds, then applies it to the smashed data it received.
  Assumed: the server holds auxiliary samples from the clients' distribution (here: the dataset's
  test split, disjoint from every client's training samples) and the client part's weights (the
  final global client part of the run: in split federated learning the sync server averages it,
  and a training server that is, or colludes with, the sync server has it), and it knows the
  defense configuration, which it applies to its auxiliary data (Kerckhoffs). Scored by SSIM and
  PSNR (torchmetrics) against the true inputs, which only the experimenter has.
- Label inference from cut gradients (`label_leak`; Li et al. 2022, "Label Leakage and Protection
  in Two-party Split Learning"): the norm attack scores each sample by its gradient's norm, the
  direction attack by its gradient's cosine similarity to the gradient of one sample of known
  label per class. Reported as ROC AUCs (scikit-learn; see `label_leak`): 0.5 is chance, 1.0
  perfect separation. In a vanilla split the labels travel with the smashed data, so the figure
  measures what the gradient channel alone reveals (to an observer of the downlink), not a secret
  the server lacks; in a U-shaped split (`cut=A,B`) the labels stay with the client, and the attack
  scores the gradients at the second cut the server receives from the client's tail.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from splitlab.models import HeadAndTail
from splitlab.privacy.defenses import Defense, decode

DECODER_WIDTH = 512
PSNR_CAP = 100.0  # dB; an exact reconstruction's PSNR is infinite, which JSON cannot hold


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


def defended_smashed(client: nn.Module, x: torch.Tensor, defense: Defense, seed: int) -> torch.Tensor:
    """What the server receives for inputs `x`: the client part's output, defended and through the wire."""
    generator = torch.Generator(x.device).manual_seed(seed)
    with torch.no_grad():
        return torch.cat([decode(defense.encode(defense.protect(client(b), generator))) for b in x.split(256)])


def cut_gradients(
    client: nn.Module, server: nn.Module, x: torch.Tensor, y: torch.Tensor, defense: Defense, batch_size: int, seed: int
) -> torch.Tensor:
    """The cut gradients the server would send for (x, y) (mean loss over each batch), as decoded."""
    grads = []
    smashed = defended_smashed(client, x, defense, seed)
    generator = torch.Generator(x.device).manual_seed(seed + 2)
    for z, labels in zip(smashed.split(batch_size), y.split(batch_size)):
        z = z.detach().requires_grad_()
        (grad,) = torch.autograd.grad(F.cross_entropy(server(z), labels), z)
        grads.append(decode(defense.send_gradient(grad, generator)))
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
        outputs = torch.cat([server(z) for z in defended_smashed(client, x, defense, seed).split(256)])
    grads = []
    for output, labels in zip(outputs.split(batch_size), y.split(batch_size)):
        output = output.detach().requires_grad_()
        (grad,) = torch.autograd.grad(F.cross_entropy(client.tail(output), labels), output)
        grads.append(grad)
    return torch.cat(grads)


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


def fit(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    passes: int,
    batch: int,
    weight_decay: float = 0.0,
) -> nn.Module:
    """`model` fitted to (inputs, targets) by Adam (lr 1e-3) over `passes` shuffled passes in
    batches of `batch`, in eval mode after: how every attacker here trains its decoder or head
    (called inside the attacker's seeded random state)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=weight_decay, foreach=True)
    for _ in range(passes):
        for idx in torch.randperm(len(inputs), device=inputs.device).split(batch):
            optimizer.zero_grad(set_to_none=True)
            loss(model(inputs[idx]), targets[idx]).backward()
            optimizer.step()
    return model.eval()


def image_scores(reconstructed: torch.Tensor, target: torch.Tensor, data_range: float) -> dict[str, float]:
    """SSIM and PSNR (torchmetrics) of reconstructed images against the true ones (N, C, H, W)."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    side = min(target.shape[-2:])
    kernel = min(11, side if side % 2 else side - 1)  # SSIM's window must fit the image (digits: 8x8)
    reconstructed = reconstructed.clamp(target.min(), target.max())  # pixels outside the range are no help
    # the Gaussian window (sigma 1.5, 11 wide) pads 5 on each side: a smaller image (a vertical party's
    # strip of digits, 4 columns) takes the uniform window of `kernel`
    ssim = structural_similarity_index_measure(
        reconstructed, target, data_range=data_range, kernel_size=kernel, gaussian_kernel=side > 5
    )
    psnr = peak_signal_noise_ratio(reconstructed, target, data_range=data_range)
    return {"ssim": float(typing.cast(torch.Tensor, ssim)), "psnr": min(float(psnr), PSNR_CAP)}


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
) -> dict[str, Any]:
    """Train a decoder on the server's auxiliary data and reconstruct the target inputs from the
    smashed data the server received: images (N, C, H, W), scored by SSIM and PSNR, or table rows
    (N, columns), scored by R^2 per column and MSE (`table_scores`). The result is the stronger of
    the decoder and the trivial attacker that answers the auxiliary data's mean (the floor): under
    strong noise a decoder can do worse than that, which must not read as privacy. Both are reported."""
    if target_inputs.dim() not in (2, 4):
        raise ValueError(
            f"input reconstruction needs images (N, C, H, W) or table rows (N, columns), not inputs of shape "
            f"{tuple(target_inputs.shape)}"
        )
    aux_smashed = defended_smashed(client, aux_inputs, defense, seed + 1)
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
