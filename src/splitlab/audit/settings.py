"""The `splitlab attack` keys (splitlab.audit.run), apart so that the attacks can name them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AttackSettings(BaseModel):
    """The `splitlab attack` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    attack: Literal[
        "inversion",
        "label_leak",
        "unsplit",
        "fsha",
        "model_completion",
        "token_inversion",
        "embedding_inversion",
        "gradient_matching",
    ]
    round: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="recorded round to attack, numbered from 1 as in metrics.jsonl (default: the last)",
    )
    client: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description="with personal client parts (psl, sglr, ...): the client whose model is attacked",
    )
    aux: int | None = Field(
        None,
        ge=10,
        le=10_000_000,
        description="auxiliary samples the attacker holds, from the test split (default: 2000 or what fits; "
        "model_completion: labelled samples, the same number of each class, default 40 of each or what fits)",
    )
    targets: int | None = Field(
        None,
        ge=10,
        le=10_000_000,
        description="held-out samples attacked when nothing was recorded (default: 500 or half the test split)",
    )
    epochs: int = Field(
        30, ge=1, le=100_000, description="training epochs of the decoder (inversions) or head (model_completion)"
    )
    iterations: int = Field(30, ge=1, le=100_000, description="alternations of input and surrogate descent (unsplit)")
    tv: float = Field(0.001, ge=0, le=1_000, description="weight of the total-variation prior (unsplit)")
    steps: int = Field(
        300,
        ge=10,
        le=10_000_000,
        description="client training steps under attack (fsha); optimisation steps per sequence (gradient_matching)",
    )
    guard: int = Field(5, ge=2, le=10_000, description="SplitGuard: a fake batch every this many steps (fsha)")
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    seed: int = Field(0, ge=0, le=2**32 - 1)
