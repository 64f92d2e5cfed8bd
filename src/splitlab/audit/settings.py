"""The `splitlab attack` and `splitlab advise` keys (splitlab.audit.run, audit.advise), apart so that the attacks
and both advisors (images and tables, language) can name them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class AttackSettings(BaseModel):
    """The `splitlab attack` keys; under each, its description (as `attack --help` shows it)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    attack: str
    """the attack: a built-in one (docs/privacy.md) or one a plugin defines"""
    plugins: str | None = Field(None, min_length=1)
    """modules of your own to import first (attacks: docs/extending.md)"""
    round: int | None = Field(None, ge=1, le=10_000_000)
    """recorded round to attack, numbered from 1 as in metrics.jsonl (default: the last)"""
    client: int = Field(0, ge=0, le=1_000_000)
    """with personal client parts (psl, sglr, ...): the client whose model is attacked"""
    aux: int | None = Field(None, ge=10, le=10_000_000)
    """auxiliary samples the attacker holds, from the test split (default: 2000 or what fits;
    model_completion: labelled samples, the same number of each class, default 40 of each or what fits)"""
    targets: int | None = Field(None, ge=10, le=10_000_000)
    """held-out samples attacked when nothing was recorded (default: 500 or half the test split)"""
    epochs: int = Field(30, ge=1, le=100_000)
    """training epochs of the decoder (inversions) or head (model_completion)"""
    iterations: int = Field(30, ge=1, le=100_000)
    """alternations of input and surrogate descent (unsplit)"""
    tv: float = Field(0.001, ge=0, le=1_000)
    """weight of the total-variation prior (unsplit)"""
    steps: int = Field(300, ge=10, le=10_000_000)
    """client training steps under attack (fsha); optimisation steps (gradient_matching per sequence, bisr)"""
    guard: int = Field(5, ge=2, le=10_000)
    """SplitGuard: a fake batch every this many steps (fsha)"""
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    seed: int = Field(0, ge=0, le=2**32 - 1)


class AdviseSettings(BaseModel):
    """The `splitlab advise` keys: the probe runs' settings, then the latency model's."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dataset: str = "fashion_mnist"
    data_dir: str | None = None
    model: str = "cnn"
    algorithm: str = "sfl_v2"
    defense: str = "none"
    clients: int = Field(4, ge=1, le=1_000_000)
    rounds: int = Field(2, ge=1, le=10_000_000)
    train_subset: int | None = Field(
        None, ge=1, le=10**10, description="probe's training samples (default: 2000 or all)"
    )
    test_subset: int | None = Field(None, ge=1, le=10**10, description="probe's test samples (default: 1500 or all)")
    batch_size: int = Field(64, ge=1, le=1_000_000)
    lr: float = Field(1e-3, gt=0, le=1e6)
    seed: int = Field(0, ge=0, le=2**32 - 1)
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    aux: int | None = Field(
        None, ge=10, le=10_000_000, description="the attacker's auxiliary samples (default: 1000 or what fits)"
    )
    targets: int | None = Field(
        None, ge=10, le=10_000_000, description="held-out samples attacked (default: 300 or what fits)"
    )
    epochs: int = Field(20, ge=1, le=100_000, description="decoder training epochs")
    max_ssim: float | None = Field(
        None, ge=0, le=1, description="budget: pick only cuts whose inversion SSIM is <= this"
    )
    max_auc: float | None = Field(
        None, ge=0, le=1, description="budget: pick only cuts whose label-leak AUCs are <= this"
    )
    max_recovery: float | None = Field(
        None,
        ge=0,
        le=1,
        description="language: pick only cuts whose recovered text (token fraction, targets included) is <= this",
    )
    cuts: str | None = Field(
        None, pattern=r"^\d+(,\d+)*$", description="language: the cuts to probe, comma-separated (default: every one)"
    )
    u_shaped: bool = Field(True, description="language: also probe cut=C,LAST (the client keeps the head and targets)")
    layers: int | None = Field(None, ge=1, le=1024, description="model=gpt: transformer blocks (default 4)")
    heads: int | None = Field(None, ge=1, le=1024, description="model=gpt: attention heads per block")
    width: int | None = Field(None, ge=1, le=65536, description="model=gpt: hidden width")
    context: int | None = Field(None, ge=1, le=1_000_000, description="model=gpt: longest sequence")
    seq_len: int | None = Field(None, ge=2, le=1_000_000, description="language: tokens per sequence")
    model_dir: str | None = Field(None, description="model=hf: the pretrained checkpoint's folder")
    lora: str | None = Field(None, description="R:ALPHA: fine-tune low-rank adapters (model=hf, or gpt with init=)")
    init: str | None = Field(None, description="a finished run (or peft folder) to start from, as for run")
    client_power: float = Field(20, gt=0, le=1e18, description="P_C (SplitGP's latency model)")
    server_power: float = Field(100, gt=0, le=1e18, description="P_S")
    rate: float = Field(1, gt=0, le=1e18, description="R, uplink rate")
    beta: float = Field(0.1, ge=0, le=1, description="fraction of samples sent to the server")
    out: str | None = Field(None, description="default runs/advise_<dataset>_<model>")

    @field_validator("cuts", mode="before")
    @classmethod
    def _one_cut(cls, value: Any) -> Any:
        """`cuts=3` reads as a number: one cut."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value
