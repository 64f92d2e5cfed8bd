"""The model zoo. Every builder returns a `StagedModel`; stage names become state-dict prefixes.

All models are written in plain torch (no torchvision) and start from random weights.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

from torch import nn

from splitlab.models.staged import StagedModel, output_shape

#: builder(input_shape, num_classes, **its params) -> a StagedModel
ModelBuilder = Callable[..., StagedModel]


def _flat_size(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: int = 200) -> StagedModel:
    """Two hidden layers of 200 (McMahan et al.'s MNIST MLP); cuts 1..2."""
    return StagedModel(
        OrderedDict(
            fc1=nn.Sequential(nn.Flatten(), nn.Linear(_flat_size(input_shape), hidden), nn.ReLU()),
            fc2=nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU()),
            out=nn.Linear(hidden, num_classes),
        )
    )


def _conv_block(
    c_in: int, c_out: int, kernel: int, pool: bool, batch_norm: bool = False, ceil_pool: bool = False
) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(c_out))
    layers.append(nn.ReLU())
    if pool:
        layers.append(nn.MaxPool2d(2, ceil_mode=ceil_pool))
    return nn.Sequential(*layers)


def cnn(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    """LEAF's FEMNIST CNN: conv32-pool-conv64-pool-fc2048-fc; cuts 1..3."""
    convs: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=_conv_block(input_shape[0], 32, 5, pool=True),
        conv2=_conv_block(32, 64, 5, pool=True),
    )
    features = _flat_size(output_shape(nn.Sequential(convs), input_shape))
    return StagedModel(
        OrderedDict(
            **convs,
            fc1=nn.Sequential(nn.Flatten(), nn.Linear(features, 2048), nn.ReLU()),
            out=nn.Linear(2048, num_classes),
        )
    )


def splitgp_cnn(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    """SplitGP's Fashion-MNIST CNN: 5 conv (3x3) + 3 fc layers; cuts 1..7, the paper cuts at 4.

    The channel widths are not printed in the paper; these reproduce its parameter counts exactly
    for 28x28 inputs and 10 classes: |phi| = 387,840 (conv1-4), |theta| = 3,480,330 (conv5 + fc),
    and the exit head at cut 4 (flatten + fc 2304 -> 10) has |h| = 23,050.
    """
    convs: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=_conv_block(input_shape[0], 32, 3, pool=False),
        conv2=_conv_block(32, 64, 3, pool=True),
        conv3=_conv_block(64, 128, 3, pool=True),
        conv4=_conv_block(128, 256, 3, pool=True),
        conv5=_conv_block(256, 256, 3, pool=False),
    )
    features = _flat_size(output_shape(nn.Sequential(convs), input_shape))
    return StagedModel(
        OrderedDict(
            **convs,
            fc1=nn.Sequential(nn.Flatten(), nn.Linear(features, 1024), nn.ReLU()),
            fc2=nn.Sequential(nn.Linear(1024, 512), nn.ReLU()),
            out=nn.Linear(512, num_classes),
        )
    )


def vgg11(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    """VGG-11 with batch norm in its CIFAR form (one fc after global pooling); cuts 1..8 (after each conv).

    Pooling rounds up so that five halvings still leave a pixel for 28x28 inputs.
    """
    widths: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]  # "M": max-pool
    stages: OrderedDict[str, nn.Module] = OrderedDict()
    c_in = input_shape[0]
    for i, width in enumerate(widths):
        if isinstance(width, str):  # "M", the pool that ends the previous block
            continue
        pool = i + 1 < len(widths) and widths[i + 1] == "M"
        stages[f"conv{len(stages) + 1}"] = _conv_block(c_in, width, 3, pool=pool, batch_norm=True, ceil_pool=True)
        c_in = width
    stages["classifier"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))
    return StagedModel(stages)


class Residual(nn.Module):
    """A ResNet block (He et al. 2016): convolutions of the given kernel sizes, each followed by
    batch norm and all but the last by ReLU, the first 3x3 one strided; the last gives `expansion` x
    `width` channels, added to the shortcut. The basic block is kernels (3, 3) and expansion 1,
    the bottleneck (1, 3, 1) and 4."""

    def __init__(self, c_in: int, width: int, stride: int, kernels: tuple[int, ...], expansion: int):
        super().__init__()
        c_out = width * expansion
        channels = [c_in, *[width] * (len(kernels) - 1), c_out]
        strided = kernels.index(3)
        layers: list[nn.Module] = []
        for i, kernel in enumerate(kernels):
            conv = nn.Conv2d(
                channels[i], channels[i + 1], kernel, stride if i == strided else 1, kernel // 2, bias=False
            )
            layers += [*([nn.ReLU()] if i else []), conv, nn.BatchNorm2d(channels[i + 1])]
        self.body = nn.Sequential(*layers)
        self.shortcut = _shortcut(c_in, c_out, stride)

    def forward(self, x):
        return (self.body(x) + self.shortcut(x)).relu()


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


def _resnet(
    kernels: tuple[int, ...], expansion: int, depths: list[int], input_shape: tuple[int, ...], num_classes: int
) -> StagedModel:
    """CIFAR-form ResNet (3x3 stem, no max-pool) of Residual blocks. Cut i = after residual stage i, i = 1..4."""
    stages: OrderedDict[str, nn.Module] = OrderedDict(
        stem=nn.Sequential(nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
    )
    c_in = 64
    for i, (width, depth) in enumerate(zip([64, 128, 256, 512], depths), start=1):
        blocks = []
        for j in range(depth):
            blocks.append(Residual(c_in, width, 2 if (i > 1 and j == 0) else 1, kernels, expansion))
            c_in = width * expansion
        stages[f"layer{i}"] = nn.Sequential(*blocks)
    stages["head"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))
    return StagedModel(stages, cut_stages={i: i + 1 for i in range(1, 5)})


def resnet18(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    return _resnet((3, 3), 1, [2, 2, 2, 2], input_shape, num_classes)


def resnet50(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    return _resnet((1, 3, 1), 4, [3, 4, 6, 3], input_shape, num_classes)


MODELS: dict[str, ModelBuilder] = {
    "mlp": mlp,
    "cnn": cnn,
    "splitgp_cnn": splitgp_cnn,
    "vgg11": vgg11,
    "resnet18": resnet18,
    "resnet50": resnet50,
}
