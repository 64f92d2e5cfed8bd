"""What the attacks share: the defended smashed data a server receives, the one way every
attacker fits its decoder or head (`fit`), image scores (SSIM / PSNR) and the picture of a
reconstruction."""

from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from splitlab.io import write_png

DECODER_WIDTH = 512
PSNR_CAP = 100.0  # dB; an exact reconstruction's PSNR is infinite, which JSON cannot hold


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


def write_picture(file: Path, originals: torch.Tensor, reconstructed: torch.Tensor) -> None:
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
