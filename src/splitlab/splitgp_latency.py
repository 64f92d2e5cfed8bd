"""SplitGP's inference-time model (Section V, Table I, Props. 1-3), from the zoo's real sizes.

Units are the paper's: computing powers P_C, P_S in parameters per time unit (forward time is
taken proportional to the parameter count), the rate R in input elements per time unit; q is the
input size and q_c the cut-layer size, both in elements per sample. beta is the fraction of test
samples sent to the server (eq. 30; the paper's Section V-A words it the other way round once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from splitlab.errors import UserError
from splitlab.models import build_model, output_shape, split


@dataclass(frozen=True)
class SplitSizes:
    """|phi|, |theta|, |h| (parameters) and q, q_c (elements per sample) of one cut."""

    phi: int
    theta: int
    head: int
    q: int
    q_c: int

    @property
    def full(self) -> int:
        return self.phi + self.theta


def split_sizes(model: str, cut: int, input_shape: tuple[int, ...] = (1, 28, 28), num_classes: int = 10) -> SplitSizes:
    """Sizes of a zoo model split at `cut`, with SplitGP's exit head (flatten + linear)."""
    client, server = split(build_model(model, input_shape, num_classes), cut)
    q_c = math.prod(output_shape(client, input_shape))
    return SplitSizes(
        phi=sum(p.numel() for p in client.parameters()),
        theta=sum(p.numel() for p in server.parameters()),
        head=q_c * num_classes + num_classes,
        q=math.prod(input_shape),
        q_c=q_c,
    )


class LatencySettings(BaseModel):
    """The `splitlab latency` keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str = "splitgp_cnn"
    cut: int = Field(4, ge=0, le=1000)
    client_power: float = Field(20, gt=0, le=1e18, description="P_C")
    server_power: float = Field(100, gt=0, le=1e18, description="P_S")
    rate: float = Field(1, gt=0, le=1e18, description="R, uplink rate")
    beta: float = Field(0.1, ge=0, le=1, description="fraction of samples sent to the server")
    samples: int = Field(1, ge=1, le=10**12, description="|D|, test samples")
    latency_budget: float | None = Field(None, gt=0, le=1e18, description="tau', latency per sample (Prop. 1)")
    phi_min: int = Field(0, ge=0, le=10**12, description="|phi_min|, smallest client part that personalizes (Prop. 1)")
    input: str = Field("1x28x28", description="input shape CxHxW (or D)")
    classes: int = Field(10, ge=2, le=1_000_000)

    @property
    def input_shape(self) -> tuple[int, ...]:
        try:
            shape = tuple(int(d) for d in str(self.input).split("x"))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:
            raise UserError(f"bad input shape {self.input!r}; expected sizes joined by x, e.g. 1x28x28")
        return shape


def table_one(s: SplitSizes, p_c: float, p_s: float, rate: float, beta: float, samples: int = 1) -> dict[str, dict]:
    """Table I: storage, client computation, communication and latency (eqs. 28-30) per scheme."""
    d = samples
    return {
        "full model at server": dict(
            storage=0, computation=0, communication=s.q * d, latency=s.q * d / rate + s.full * d / p_s
        ),
        "full model at client": dict(storage=s.full, computation=s.full * d, communication=0, latency=s.full * d / p_c),
        "splitgp": dict(
            storage=s.phi + s.head,
            computation=(s.phi + s.head) * d,
            communication=beta * s.q_c * d,
            latency=(s.phi + s.head) * d / p_c + beta * s.q_c * d / rate + beta * s.theta * d / p_s,
        ),
    }


def max_client_part(s: SplitSizes, p_c: float, p_s: float, rate: float, beta: float, budget: float) -> float:
    """Prop. 1 (eq. 31): the largest |phi| whose per-sample latency stays within `budget`
    (|w| = |phi| + |theta| held fixed, as the proposition does)."""
    return p_c * p_s * (budget - beta * s.q_c / rate - s.head / p_c - beta * s.full / p_s) / (p_s - beta * p_c)


def client_power_threshold(s: SplitSizes, p_s: float, rate: float, beta: float) -> float:
    """Prop. 2 (eq. 32): SplitGP is no slower than the full model at the client iff P_C <= this."""
    if beta == 0:
        return math.inf
    return (s.theta - s.head) / (beta * (s.q_c / rate + s.theta / p_s))


@dataclass(frozen=True)
class RateThreshold:
    """Prop. 3's answer: SplitGP is no slower than the full model at the server iff R `op` `value`
    (op "<=" or ">="); `value` is inf for "at every rate" and 0 with "<=" for "never"."""

    op: str
    value: float

    def holds(self, rate: float) -> bool:
        return rate <= self.value if self.op == "<=" else rate >= self.value

    def __str__(self) -> str:
        if self.op == "<=" and self.value == math.inf:
            return "at every rate R"
        if self.op == "<=" and self.value <= 0:
            return "at no rate R"
        return f"iff R {self.op} {self.value:,.6g}"


def rate_threshold(s: SplitSizes, p_c: float, p_s: float, beta: float) -> RateThreshold:
    """Prop. 3: when SplitGP is no slower than the full model at the server.

    From eqs. (29)-(30) the server-side term is (|phi| + (1 - beta)|theta|) / P_S; the paper's
    eq. (33) prints (1 - beta)(|phi| + |theta|) / P_S. SplitGP minus server latency per sample is
    den - num / R with num = q - beta q_c, den = (|phi| + |h|) / P_C - (|phi| + (1 - beta)|theta|) / P_S,
    so SplitGP wins iff R den <= num: R <= num / den when den > 0 (never if num < 0); when den < 0
    (the client work is cheaper than the server's saving) R >= num / den, which is every rate when
    num >= 0 and a lower bound when both are negative (it sends more than the raw input, so it
    needs a fast enough link); when den = 0, every rate iff num >= 0.
    """
    numerator = s.q - beta * s.q_c
    denominator = (s.phi + s.head) / p_c - (s.phi + (1 - beta) * s.theta) / p_s
    if denominator > 0:
        return RateThreshold("<=", max(numerator, 0.0) / denominator)
    if numerator >= 0:
        return RateThreshold("<=", math.inf)
    if denominator == 0:
        return RateThreshold("<=", 0.0)
    return RateThreshold(">=", numerator / denominator)


def report(settings: LatencySettings) -> dict:
    """Everything `splitlab latency` prints: Table I at the chosen cut, Props. 2-3, and every cut."""
    shape, st = settings.input_shape, settings
    sizes = split_sizes(st.model, st.cut, shape, st.classes)
    cuts = []
    for cut in build_model(st.model, shape, st.classes).valid_cuts:
        s = split_sizes(st.model, cut, shape, st.classes)
        latency = table_one(s, st.client_power, st.server_power, st.rate, st.beta)["splitgp"]["latency"]
        row = dict(cut=cut, phi=s.phi, theta=s.theta, head=s.head, q_c=s.q_c, latency_per_sample=latency)
        if st.latency_budget is not None:
            bound = max_client_part(s, st.client_power, st.server_power, st.rate, st.beta, st.latency_budget)
            row.update(max_phi=bound, feasible=st.phi_min <= s.phi <= bound)
        cuts.append(row)
    return {
        "sizes": vars(sizes),
        "table_one": table_one(sizes, st.client_power, st.server_power, st.rate, st.beta, st.samples),
        "client_power_threshold": client_power_threshold(sizes, st.server_power, st.rate, st.beta),
        "rate_threshold": rate_threshold(sizes, st.client_power, st.server_power, st.beta),  # a RateThreshold
        "cuts": cuts,
    }
