"""A GPT-2-architecture decoder in plain torch, staged by block (nanoGPT's layout, randomly initialised).

Stages: `embed` (token + position embeddings: int64 ids (B, T) -> hidden states (B, T, D)),
`block1` .. `blockN` (pre-norm causal self-attention and MLP, (B, T, D) -> (B, T, D)) and `head`
(final layer norm + LM head -> logits (B, T, V)). Cut c = after block c: the client holds the
embedding and blocks 1..c. The LM head is not tied to the token embedding (GPT-2 ties them): with
a cut between them, tying would make the two sides share a tensor that only one of them can hold.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from splitlab.errors import UserError
from splitlab.models import packed
from splitlab.models.staged import StagedModel


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)  # query, key and value in one projection
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        # written out rather than F.scaled_dot_product_attention, whose fused CPU kernels have no
        # second derivative (FSL-SAGE's alignment differentiates a cut gradient)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        y = F.softmax(scores.masked_fill(packed.other_rows(tokens, x.device), float("-inf")), dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).reshape(batch, tokens, width))


class Block(nn.Module):
    """One transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(c_fc=nn.Linear(width, 4 * width), gelu=nn.GELU(), c_proj=nn.Linear(4 * width, width))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embedding(nn.Module):
    """Token plus learned position embeddings (positions from each packed row's start: models/packed.py)."""

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.wte(tokens) + self.wpe(packed.positions(tokens.shape[1], tokens.device))


class GptParams(BaseModel):
    """`model=gpt`'s own keys: its sizes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    layers: int = Field(4, ge=1, le=1024, description="model=gpt: transformer blocks")
    heads: int = Field(4, ge=1, le=1024, description="model=gpt: attention heads per block")
    width: int = Field(128, ge=1, le=65536, description="model=gpt: hidden width D, a multiple of heads")
    context: int = Field(256, ge=1, le=1_048_576, description="model=gpt: the longest sequence it takes, in tokens")

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GptParams:
        if self.width % self.heads:
            raise UserError(f"width={self.width} must be a multiple of heads={self.heads}")
        return self


def gpt(
    input_shape: tuple[int, ...], num_classes: int, layers: int, heads: int, width: int, context: int
) -> StagedModel:
    """GPT-2's architecture over a vocabulary of `num_classes` tokens, for sequences of
    `input_shape[0]` tokens (at most `context`); cuts 1..layers (after each block).

    Initialised as GPT-2: normal(0, 0.02) weights, zero biases, and the residual projections
    scaled by 1/sqrt(2 * layers)."""
    if len(input_shape) != 1:
        raise UserError(f"model=gpt takes token sequences; the dataset's samples have shape {input_shape}")
    if input_shape[0] > context:
        raise UserError(f"seq_len={input_shape[0]} is beyond the model's context of {context} tokens")
    stages: OrderedDict[str, nn.Module] = OrderedDict(embed=Embedding(num_classes, context, width))
    for i in range(1, layers + 1):
        stages[f"block{i}"] = Block(width, heads)
    stages["head"] = nn.Sequential(
        OrderedDict(ln_f=nn.LayerNorm(width), lm_head=nn.Linear(width, num_classes, bias=False))
    )
    model = StagedModel(stages, cut_stages={c: c + 1 for c in range(1, layers + 1)})
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj") else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    return model
