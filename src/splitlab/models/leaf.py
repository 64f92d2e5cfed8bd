"""The CycleSL paper's models (its Appendix E, Tables 9-11): LEAF's LSTM and CelebA CNN, and ResNet-9.

LEAF's FEMNIST CNN is the zoo's `cnn` (conv32-pool-conv64-pool-fc2048-fc; 3136 features for
28x28 inputs); the paper cuts it after the second conv block, which is `cut=2` there.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial

import torch
from torch import nn

from splitlab.models.staged import StagedModel, output_shape
from splitlab.models.zoo import _conv_block, _flat_size

_block = partial(_conv_block, kernel=3, batch_norm=True)  # conv3x3, batch norm, ReLU[, max-pool]


class TokenEmbedding(nn.Embedding):
    """An embedding that takes token ids of any integer dtype (datasets store them as uint8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.long())


class LastStep(nn.Module):
    """A stacked LSTM over the whole sequence; its output at the last step feeds the classifier."""

    def __init__(self, input_size: int, hidden: int, layers: int):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, num_layers=layers, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0][:, -1]


def lstm(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    """LEAF's Shakespeare model (stacked_lstm.py): embedding 8, 2 x LSTM 256, fc to the vocabulary.

    Inputs are (T,) token ids and the vocabulary is the class set. One cut, `cut=1`, after the
    LSTM, as in the paper; a cut after the embedding would send what is a per-character lookup
    of the raw text.
    """
    if len(input_shape) != 1:
        raise RuntimeError("lstm takes sequences of token ids, input shape (T,)")
    return StagedModel(
        OrderedDict(
            embed=TokenEmbedding(num_classes, 8),
            lstm=LastStep(8, 256, layers=2),
            out=nn.Linear(256, num_classes),
        ),
        cut_stages={1: 2},
    )


class ImageBytes(nn.Module):
    """uint8 images -> float in [0, 1]; float inputs pass unchanged (big image sets stay uint8)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().div_(255.0) if x.dtype == torch.uint8 else x


def celeba_cnn(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    """LEAF's CelebA CNN: 4 x (conv3x3 32, batch norm, max-pool, ReLU), fc; cuts 1..4 after each
    conv block, the paper's is 2. (ReLU and max-pool commute, so the zoo's block order is the same
    function.) 84x84 inputs give 32x5x5 = 800 features, as in the paper's Table 10."""
    convs: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Sequential(ImageBytes(), _block(input_shape[0], 32, pool=True))
    )
    for i in range(2, 5):
        convs[f"conv{i}"] = _block(32, 32, pool=True)
    features = _flat_size(output_shape(nn.Sequential(convs), input_shape))
    return StagedModel(OrderedDict(**convs, out=nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))))


class Residual(nn.Module):
    """x + body(x), ResNet-9's residual block (no activation after the sum)."""

    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(_block(channels, channels, pool=False), _block(channels, channels, pool=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


def resnet9(input_shape: tuple[int, ...], num_classes: int) -> StagedModel:
    """ResNet-9 of the CycleSL CIFAR-100 experiments (after the Kaggle "cifar10-resnet-90-accuracy"
    notebook): 4 conv blocks, 2 residual blocks, a projection head; cuts 1..6 after each block, as
    in the paper's Table 5; its default split is cut 3 (conv1, conv2, res1 on the client).

    The head max-pools globally, which is the original MaxPool2d(4) for 32x32 inputs."""
    return StagedModel(
        OrderedDict(
            conv1=_block(input_shape[0], 64, pool=False),
            conv2=_block(64, 128, pool=True),
            res1=Residual(128),
            conv3=_block(128, 256, pool=True),
            conv4=_block(256, 512, pool=True),
            res2=Residual(512),
            head=nn.Sequential(nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)),
        )
    )


LEAF_MODELS = {"lstm": lstm, "celeba_cnn": celeba_cnn, "resnet9": resnet9}
