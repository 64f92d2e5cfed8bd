"""UnSplit (Erdogan, Küpçü & Cicek 2022, "UnSplit: Data-Oblivious Model Inversion, Model Stealing,
and Label Inference Attacks Against Split Learning"): input reconstruction without data or weights.

The server knows the client part's architecture, not its weights, and holds no sample of the
clients' data. For the smashed data Z it received it keeps a guessed input X' and a surrogate
client part f' (the architecture, freshly initialised) and descends, by alternating coordinate
descent as in the paper, on

    ||f'(X') - Z||^2 / n + tv * TV(X')

STEPS steps on X' (the surrogate fixed), then STEPS on f' (X' fixed), for `iterations` rounds. TV
is the total variation prior of the paper, the mean absolute difference of neighbouring pixels.
One surrogate serves every batch of targets (the paper's model-stealing clone, refined batch
after batch). Two facts about the input format are assumed known, not learnt from data: its
value range (X' is kept inside it) and that background is the range's low end (X' starts there).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from splitlab.audit.attack import Attack, Target
from splitlab.audit.common import image_scores, write_picture
from splitlab.errors import UserError
from splitlab.privacy.defenses import received

BATCH = 128  # targets reconstructed together, sharing the surrogate
STEPS = 10  # descent steps on each coordinate (input, surrogate) per alternation
LR = 0.03  # Adam's, for both coordinates


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference between vertically and horizontally neighbouring pixels."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def surrogate_of(architecture: nn.Module, seed: int) -> nn.Module:
    """The client part's architecture with fresh weights of the attacker's own (seeded) draw."""
    surrogate = copy.deepcopy(architecture).train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, module in surrogate.named_modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
            elif any(True for _ in module.parameters(recurse=False)):  # it would keep the client's weights
                raise ValueError(f"cannot draw fresh weights for the client part's layer {name!r}")
    for parameter in surrogate.parameters():
        parameter.requires_grad_(True)
    return surrogate


def unsplit(
    architecture: nn.Module,
    smashed: torch.Tensor,
    input_shape: tuple[int, ...],
    value_range: tuple[float, float],
    iterations: int,
    tv: float,
    seed: int,
) -> torch.Tensor:
    """Reconstructed inputs (N, *input_shape) for the smashed data (N, ...), by UnSplit."""
    low, high = value_range
    surrogate = surrogate_of(architecture, seed)
    model_optimizer = torch.optim.Adam(surrogate.parameters(), lr=LR, foreach=True)
    reconstructed = []
    for target in smashed.detach().split(BATCH):
        guess = torch.full((len(target), *input_shape), low, device=target.device, requires_grad=True)
        input_optimizer = torch.optim.Adam([guess], lr=LR, foreach=True)
        for _ in range(iterations):
            for _ in range(STEPS):  # the input, the surrogate fixed
                input_optimizer.zero_grad(set_to_none=True)
                (F.mse_loss(surrogate(guess), target) + tv * total_variation(guess)).backward()
                input_optimizer.step()
                with torch.no_grad():
                    guess.clamp_(low, high)
            fixed = guess.detach()
            for _ in range(STEPS):  # the surrogate, the input fixed
                model_optimizer.zero_grad(set_to_none=True)
                F.mse_loss(surrogate(fixed), target).backward()
                model_optimizer.step()
        reconstructed.append(guess.detach())
    return torch.cat(reconstructed)


def scored_unsplit(
    architecture: nn.Module,
    smashed: torch.Tensor,
    target_inputs: torch.Tensor,
    value_range: tuple[float, float],
    mean_image: torch.Tensor,
    settings: dict[str, Any],
    seed: int,
) -> dict[str, Any]:
    """UnSplit on `smashed`, scored (SSIM/PSNR) against the true inputs, beside the mean-image
    floor of the inversion attack. The floor needs auxiliary data this attacker does not have, so
    it is not folded into the figure: it says whether the data-oblivious attacker does better than
    one that only knows the average input."""
    if target_inputs.dim() != 4:
        raise ValueError(
            f"input reconstruction needs images (N, C, H, W), not inputs of shape {tuple(target_inputs.shape)}"
        )
    reconstructed = unsplit(architecture, smashed, tuple(target_inputs.shape[1:]), value_range, seed=seed, **settings)
    data_range = float(target_inputs.max() - target_inputs.min())
    return {
        **image_scores(reconstructed, target_inputs, data_range),
        "baseline": image_scores(mean_image.expand_as(target_inputs), target_inputs, data_range),
        "samples": len(target_inputs),
        "reconstructed": reconstructed[:16].cpu(),
    }


class UnSplit(Attack):
    name = "unsplit"
    inputs = ("images",)
    why = "it reconstructs images by descent on the input and a total-variation prior"

    def run(self, target: Target) -> dict[str, Any]:
        x, settings, data = target.x, target.settings, target.experiment.data
        if target.recorded:
            x, smashed = (target.recorded[1][name].to(x.device) for name in ("inputs", "smashed"))
        else:
            smashed = received(target.client, x, target.defense, settings.seed)
        try:
            scores = scored_unsplit(
                target.client,
                smashed,
                x,
                (float(data.test_x.min()), float(data.test_x.max())),  # the input format's range
                target.aux_x.mean(0, keepdim=True),
                {"iterations": settings.iterations, "tv": settings.tv},
                settings.seed,
            )
        except ValueError as error:
            raise UserError(f"cannot attack {str(target.path)!r}: {error}") from None
        write_picture(target.path / "attack_unsplit.png", x[:16].cpu(), scores.pop("reconstructed"))
        return scores

    @staticmethod
    def rows(result: dict[str, Any]) -> list[tuple[str, str]]:
        baseline = result["baseline"]
        return [
            ("SSIM / PSNR (unsplit, no data)", f"{result['ssim']:.3f} / {result['psnr']:.2f} dB"),
            ("floor: mean image", f"{baseline['ssim']:.3f} / {baseline['psnr']:.2f} dB"),
        ]
