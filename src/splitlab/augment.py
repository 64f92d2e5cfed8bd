"""Augmentations of training batches: `augment=NAME[:ARG]+...`, applied in order, a registry a plugin
can add to (`splitlab.register_augmentation`).

    flip        each image mirrored left-right with probability 1/2
    crop:<pad>  each image padded with <pad> zeros on every side, then cut back to its size at a
                random offset (the CIFAR recipe is crop:4+flip)

A client augments the mini-batches it trains on, as stored (uint8 images before their scaling, so
the padding is black), and nothing else: evaluation, held-out and test samples are untouched. The
random choices come from the stream keyed by (seed, round, client, epoch, batch), so a run is
the same on every transport and a resumed run replays them exactly. The built-ins take images
(samples C x H x W); a dataset of other samples (tables, text) refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from splitlab.errors import UserError
from splitlab.named_options import Registry
from splitlab.random_streams import register_stream

STREAM_AUGMENT = register_stream("augment", 6)


@dataclass(frozen=True)
class Augmentation:
    """`apply(stored batch, generator) -> batch of the same shape and dtype`; `images`: it takes only
    image samples (C, H, W)."""

    apply: Callable[[torch.Tensor, np.random.Generator], torch.Tensor]
    images: bool = True


def _flip() -> Augmentation:
    def apply(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        flipped = torch.as_tensor(rng.integers(0, 2, len(x), dtype=bool), device=x.device)
        return torch.where(flipped.view(-1, 1, 1, 1), x.flip(-1), x)

    return Augmentation(apply)


def _crop(pad: float) -> Augmentation:
    if pad != int(pad) or not 1 <= pad <= 1024:
        raise ValueError("pad must be a whole number of pixels from 1 to 1024")
    pixels = int(pad)

    def apply(x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
        n, channels, height, width = x.shape
        padded = F.pad(x, (pixels,) * 4)
        top, left = (torch.as_tensor(rng.integers(0, 2 * pixels + 1, n), device=x.device) for _ in range(2))
        rows = (top[:, None] + torch.arange(height, device=x.device)).view(n, 1, height, 1)
        cols = (left[:, None] + torch.arange(width, device=x.device)).view(n, 1, 1, width)
        samples = torch.arange(n, device=x.device).view(n, 1, 1, 1)
        return padded[samples, torch.arange(channels, device=x.device).view(1, channels, 1, 1), rows, cols]

    return Augmentation(apply)


AUGMENTATIONS: Registry[Augmentation] = Registry(
    "augmentation", {"flip": (_flip, "flip"), "crop": (_crop, "crop:<pad>")}
)


def register_augmentation(name: str, make: Callable[..., Augmentation], form: str | None = None) -> None:
    """Make `augment=name[:a...]` apply `make(a, ...)` (floats), an `Augmentation`; `form` shows its
    arguments in messages. A plugin's name may be registered again, a built-in one may not."""
    AUGMENTATIONS.register(name, make, form)


def parse_augment(value: str) -> list[Augmentation]:
    """The augmentations `value` names, in order ("none": none); ValueError saying what is allowed."""
    if value == "none":
        return []
    return [AUGMENTATIONS.make(part) for part in value.split("+")]


def check_augment(value: str, dataset: str, input_shape: tuple[int, ...], task: str) -> None:
    """UserError where the dataset's samples are not what the augmentations take."""
    if task == "classification" and len(input_shape) == 3:
        return
    if any(augmentation.images for augmentation in parse_augment(value)):
        samples = "token sequences" if task == "language" else f"of shape {input_shape}"
        raise UserError(
            f"augment={value} transforms images (samples C x H x W); {dataset}'s samples are {samples}: "
            f"use augment=none"
        )


def augmented(augmentations: list[Augmentation], x: torch.Tensor, rng: np.random.Generator) -> torch.Tensor:
    """A stored batch after every augmentation, in order, each drawing from `rng` in turn."""
    for augmentation in augmentations:
        x = augmentation.apply(x, rng)
    return x
