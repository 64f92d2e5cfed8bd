"""Defenses at the cut: what a client does to its smashed data before it leaves, and how the cut
layer's tensors are compressed on the wire.

`defense=` is `none` or `+`-joined items:

- `clip:C`: each sample's activations scaled to L2 norm at most C (differentiable, the client
  back-propagates through it);
- `noise:S`: Gaussian noise added to each released activation, standard deviation S * C with
  `clip:C`, S without clipping. With both, every release is a Gaussian mechanism (see
  splitlab.privacy.accounting);
- `dp:epsilon=E` (optionally `,delta=D`, default 1e-5), with `clip:C`: the noise calibrated so
  that the run's releases of each sample are (E, D)-DP (splitlab.privacy.accounting.calibrated);
- `gradnoise:S`: isotropic Gaussian noise on each sample's cut gradient, added by the training
  server before the gradient goes down, with expected norm S times the batch's largest gradient
  norm (the "iso" protection of Li et al. 2022 against label inference from cut gradients);
- `marvell[:S]`: Marvell (Li et al. 2022): on a binary task the server, which holds the labels,
  adds to each cut gradient Gaussian noise whose covariance depends on the sample's class, chosen
  to minimise the symmetrised KL divergence between the two classes' gradient distributions
  under a power budget S x ||mean positive gradient - mean negative gradient||^2 (`marvell_variances`);
  `marvell:kl=K`: per batch, the smallest such budget whose optimum's symmetrised KL is at most K
  (the reference code's dynamic mode, `marvell_kl_scale`);
- `dchi:E`: d_chi-privacy (metric DP) of each token's embedding (Feyisetan et al. 2020): on a
  language model the client adds to the embedding stage's output, per token, noise of density
  proportional to exp(-E ||z||), which the client's later stages only post-process;
- `label_dp:E`: randomised response on the labels a client sends (E-label-DP, Warner 1965 /
  Ghazi et al. 2021): each kept with probability e^E / (e^E + K - 1), else a uniformly drawn other class;

All noise is drawn from the applying party's own secret (splitlab.privacy.keys), never from the
run's seed, which the other side knows.
- `nopeek:A`: NoPeek (Vepakomma et al. 2020): A * distance correlation between the client's
  inputs (token sequences as their one-hot encodings) and its smashed data is added to the
  client's objective;
- `quantize:int8` (per-sample scale, symmetric) or `quantize:fp16`, and `topk:F` (each sample
  keeps its ceil(F * d) largest-magnitude entries): compression of both smashed data (up) and cut
  gradients (down). The compressed form is what travels through the verbs, so the ledger counts
  what is really sent; the receiver decodes it (`decode`), checking every tensor it is given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from splitlab.errors import UserError
from splitlab.models.staged import HeadAndTail

#: the delta of (epsilon, delta) when none is given (`dp:epsilon=E`, and the reported epsilon)
DELTA = 1e-5
#: `defense=` items and what each expects, for the one-line refusal
ITEMS = {
    "clip": "clip:<max L2 norm > 0>",
    "noise": "noise:<sigma in [0, 1e6]>",
    "gradnoise": "gradnoise:<scale in [0, 1e6]>",
    "dp": "dp:epsilon=<E > 0>[,delta=<D in (0, 1)>] (with clip:C, without noise:S)",
    "nopeek": "nopeek:<alpha >= 0>",
    "quantize": "quantize:int8|fp16",
    "topk": "topk:<fraction in (0, 1]>",
    "marvell": "marvell[:<power scale > 0>] or marvell:kl=<sumKL bound > 0>",
    "label_dp": "label_dp:<epsilon > 0>",
    "dchi": "dchi:<epsilon > 0>",
}
#: the largest noise scale taken (noise:S, gradnoise:S): 1e6 buries any activation or gradient a model
#: computes, and larger ones (1e308) overflow float32 to inf, so that the run would only diverge
NOISE_LIMIT = 1e6
#: Marvell's power scale without `:S` (Li et al.'s s, P = s ||mean positive - mean negative||^2): the paper sweeps
#: it, its reference code defaults to 1; on breast_cancer s = 0.1 to 4 left an attack more than 0.1 from chance in
#: most of 9 runs (3 seeds x 3 noise keys; the norm AUC reversed, down to 0.32), 16 held in all 9 (docs/privacy.md)
MARVELL_SCALE = 16.0
#: `marvell:kl=K`: the scale found is within this relative distance above the smallest that meets K ...
KL_SCALE_TOLERANCE = 1e-3
#: ... and at most this (reached only by a batch no budget brings to K: both classes' gradients without spread)
KL_SCALE_LIMIT = 2.0**40
FP16_MAX = torch.finfo(torch.float16).max
#: relative error of fp16 for normal values (10 stored mantissa bits, round to nearest) ...
FP16_RELATIVE_ERROR = 2.0**-11
#: ... and the absolute error below its normal range (half the smallest subnormal step)
FP16_ABSOLUTE_ERROR = 2.0**-25


@dataclass(frozen=True)
class MarvellLevel:
    """Marvell's noise level: `value` is the power scale S (P = S x ||g||^2, `marvell:S`) or, with
    `kl`, a bound K on the optimum's symmetrised KL divergence, the scale then found per batch
    (`marvell:kl=K`, the reference code's dynamic mode; `marvell_kl_scale`)."""

    value: float
    kl: bool = False


@dataclass(frozen=True)
class Defense:
    """A parsed `defense=`; the default is no defense, under which every method is the identity."""

    clip: float | None = None
    noise: float = 0.0
    gradnoise: float = 0.0
    nopeek: float = 0.0
    quantize: str | None = None
    topk: float | None = None
    #: `dp:epsilon=E,delta=D`: the target the noise is calibrated to (splitlab.privacy.accounting)
    dp: tuple[float, float] | None = None
    #: `marvell:S` or `marvell:kl=K`: the noise level (the server's cut gradients, binary labels)
    marvell: MarvellLevel | None = None
    #: `label_dp:E`: the epsilon of randomised response on the labels clients send
    label_dp: float | None = None
    #: `dchi:E`: the epsilon of d_chi-privacy on each token's embedding (language models)
    dchi: float | None = None

    @property
    def random(self) -> bool:
        """Whether a party draws noise (and so needs its noise key)."""
        return (
            self.noise > 0
            or self.gradnoise > 0
            or self.dp is not None
            or self.marvell is not None
            or self.label_dp is not None
            or self.dchi is not None
        )

    @property
    def noises_gradients(self) -> bool:
        """Whether the training server draws noise for the cut gradients it sends."""
        return self.gradnoise > 0 or self.marvell is not None

    @property
    def noise_std(self) -> float:
        return self.noise * (self.clip if self.clip is not None else 1.0)

    # --- at the client, before smashed data leaves -------------------------------------------
    def protect(self, smashed: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Clip each sample's activations and add noise; differentiable (the cut gradient is
        applied to this tensor). Without clip and noise, `smashed` itself."""
        if self.clip is not None:
            norms = smashed.flatten(1).norm(dim=1).clamp_min(1e-12)
            factor = (self.clip / norms).clamp(max=1.0)
            smashed = smashed * factor.view(-1, *([1] * (smashed.dim() - 1)))
        if self.noise > 0:
            noise = torch.randn(smashed.shape, generator=generator, device=smashed.device, dtype=smashed.dtype)
            smashed = smashed + self.noise_std * noise
        return smashed

    def client_output(self, client: nn.Module, x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The client part on `x`: with `dchi:E`, d_chi-privacy noise on every token's embedding
        (the first stage's output), which the client's later stages only post-process (in a
        U-shaped split, those before the first cut: calling a `HeadAndTail` runs its head)."""
        if self.dchi is None:
            return client(x)
        first, *rest = list(client.children())[: client.head_stages if isinstance(client, HeadAndTail) else None]
        hidden = first(x)
        hidden = hidden + dchi_noise(hidden, self.dchi, generator)
        for stage in rest:
            hidden = stage(hidden)
        return hidden

    @property
    def changes_forward(self) -> bool:
        """Whether the server's input differs from the undefended client part's output (dchi, clip,
        noise, compression)."""
        return (
            self.dchi is not None
            or self.clip is not None
            or self.noise > 0
            or self.quantize is not None
            or self.topk is not None
        )

    def deployed(self, client: nn.Module, server: nn.Module, generator: torch.Generator) -> nn.Module:
        """The split model as it runs in deployment: the defense applied (for accuracy as deployed)."""
        return nn.Sequential(_Defended(self, client, generator), server)

    def penalty(self, inputs: torch.Tensor, smashed: torch.Tensor) -> torch.Tensor | None:
        """NoPeek's term of the client's objective (None without NoPeek)."""
        if self.nopeek == 0:
            return None
        return self.nopeek * distance_correlation(inputs, smashed.flatten(1))

    def private_labels(self, labels: torch.Tensor, classes: int, generator: torch.Generator | None) -> torch.Tensor:
        """The labels as sent: with `label_dp:E`, randomised response over `classes` classes
        (each kept with probability e^E / (e^E + K - 1), else a uniformly drawn other class)."""
        if self.label_dp is None:
            return labels
        kept = torch.rand(labels.shape, generator=generator, device=labels.device) < keep_probability(
            self.label_dp, classes
        )
        shift = torch.randint(1, classes, labels.shape, generator=generator, device=labels.device)
        return torch.where(kept, labels, (labels + shift) % classes)

    # --- at the training server, before a cut gradient goes down ---------------------------
    def send_gradient(
        self, grad: torch.Tensor, generator: torch.Generator | None, labels: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, Any]:
        """The cut gradient as sent: with `gradnoise` and `marvell`, noise from the server's
        `generator` (Marvell's depends on each sample's label), then encoded."""
        if self.gradnoise > 0:
            largest = grad.flatten(1).norm(dim=1).max()
            noise = torch.randn(grad.shape, generator=generator, device=grad.device, dtype=grad.dtype)
            grad = grad + noise * (self.gradnoise * largest / math.sqrt(grad[0].numel()))
        if self.marvell is not None:
            if labels is None:
                raise RuntimeError("Marvell's noise needs the labels of the gradients it protects")
            if len(grad) == len(labels):  # one vector for a whole batch (SGLR's average) has no sample's label
                grad = grad + marvell_noise(grad, labels, self.marvell, generator)
        return self.encode(grad)

    # --- on the wire, both directions ---------------------------------------------------------
    def encode(self, tensor: torch.Tensor) -> torch.Tensor | dict[str, Any]:
        """`tensor` (a batch) as sent: top-k entries per sample and/or quantized values."""
        tensor = tensor.detach()
        if self.topk is None:
            return self._quantized(tensor)
        flat = tensor.flatten(1)
        k = math.ceil(self.topk * flat.shape[1])
        indices = flat.abs().topk(k, dim=1, sorted=False).indices
        return {
            "values": self._quantized(flat.gather(1, indices)),
            "indices": indices.to(torch.int32),
            "shape": torch.tensor(tensor.shape, dtype=torch.int32),
        }

    def _quantized(self, tensor: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if self.quantize == "fp16":
            return {"fp16": tensor.clamp(-FP16_MAX, FP16_MAX).half()}
        if self.quantize == "int8":
            scale = tensor.flatten(1).abs().amax(dim=1).float() / 127
            safe = scale.clamp_min(torch.finfo(torch.float32).tiny).view(-1, *([1] * (tensor.dim() - 1)))
            return {"int8": (tensor / safe).round().clamp(-127, 127).to(torch.int8), "scale": scale}
        return tensor


class _Defended(nn.Module):
    """The client part with its defenses and the wire compression: what the server part receives."""

    def __init__(self, defense: Defense, client: nn.Module, generator: torch.Generator | None) -> None:
        super().__init__()
        self.defense, self.client, self.generator = defense, client, generator

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        smashed = self.defense.client_output(self.client, x, self.generator)
        return decode(self.defense.encode(self.defense.protect(smashed, self.generator)))


def received(client: nn.Module, x: torch.Tensor, defense: Defense, seed: int) -> torch.Tensor:
    """What a server receives for inputs `x`, every defense applied (noise from a generator seeded
    `seed`: an attacker's own draw, Kerckhoffs), in batches of 256, without gradients."""
    defended = _Defended(defense, client, torch.Generator(x.device).manual_seed(seed))
    with torch.no_grad():
        return torch.cat([defended(b) for b in x.split(256)])


def decode(message: Any) -> torch.Tensor:
    """A received cut-layer tensor from its wire form (a plain tensor is returned as it is).

    Every part of a compressed form is checked (structure, dtypes, shapes, index range, finite
    scales) before use: the message comes from the other side of the network."""
    if isinstance(message, torch.Tensor):  # sent as it is: no defense compresses this direction
        if not message.is_floating_point():
            raise ValueError(f"a cut-layer tensor must be floating point, not {message.dtype}")
        return message
    if not isinstance(message, Mapping):
        raise ValueError(f"a cut-layer message must be a tensor or a dict, not {type(message).__name__}")
    keys = set(message)
    if keys == {"fp16"}:
        return _finite(_typed(message, "fp16", torch.float16).float())
    if keys == {"int8", "scale"}:
        values, scale = _typed(message, "int8", torch.int8), _typed(message, "scale", torch.float32)
        if values.dim() < 1 or scale.shape != values.shape[:1]:
            raise ValueError(f"int8 values of shape {tuple(values.shape)} with scales of shape {tuple(scale.shape)}")
        return values.float() * _finite(scale).view(-1, *([1] * (values.dim() - 1)))
    if keys == {"values", "indices", "shape"}:
        values, indices = decode(message["values"]), _typed(message, "indices", torch.int32)
        shape = [int(n) for n in _typed(message, "shape", torch.int32)]
        if len(shape) < 1 or min(shape) < 0 or values.shape != indices.shape or values.dim() != 2:
            raise ValueError("top-k values and indices disagree in shape, or the shape is invalid")
        width = math.prod(shape[1:])
        if values.shape[0] != shape[0] or (indices.numel() and (indices.min() < 0 or indices.max() >= width)):
            raise ValueError(f"top-k indices out of range for shape {shape}")
        dense = torch.zeros(shape[0], width, dtype=values.dtype, device=values.device)
        return dense.scatter(1, indices.long(), values).view(shape)
    raise ValueError(f"unknown cut-layer message with keys {sorted(keys)}")


def _typed(message: Mapping, key: str, dtype: torch.dtype) -> torch.Tensor:
    value = message[key]
    if not isinstance(value, torch.Tensor) or value.dtype != dtype:
        raise ValueError(f"cut-layer message field {key!r} must be a {dtype} tensor")
    return value


def _finite(tensor: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(tensor).all()):
        raise ValueError("a compressed cut-layer tensor holds values that are not finite")
    return tensor


def backward(*pairs: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    """Back-propagate the client's objective: (tensor, gradient) pairs, gradient None for a loss;
    a pair whose tensor is None (no NoPeek penalty) is left out."""
    kept = [(tensor, grad) for tensor, grad in pairs if tensor is not None]
    torch.autograd.backward([tensor for tensor, _ in kept], [grad for _, grad in kept])


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation of two batches (rows are samples): 0 iff independent, in the limit.
    Integer `x` are token sequences, compared as their one-hot encodings (a token id's size means
    nothing): distance sqrt(2 x the positions where they differ), without building the encodings."""

    def centered(a: torch.Tensor) -> torch.Tensor:
        if a.dtype.is_floating_point:
            d = torch.cdist(a.flatten(1).float(), a.flatten(1).float())
        else:
            d = (2 * (a[:, None] != a[None]).flatten(2).sum(-1)).float().sqrt()
        return d - d.mean(0, keepdim=True) - d.mean(1, keepdim=True) + d.mean()

    a, b = centered(x), centered(z)
    dcov2_xz, dcov2_xx, dcov2_zz = (a * b).mean(), (a * a).mean(), (b * b).mean()
    return (dcov2_xz.clamp_min(0) / (dcov2_xx * dcov2_zz).sqrt().clamp_min(1e-12)).clamp_min(1e-12).sqrt()


def dchi_noise(embeddings: torch.Tensor, epsilon: float, generator: torch.Generator | None) -> torch.Tensor:
    """Noise for each vector along the last axis (a token's embedding, dimension d) with density
    proportional to exp(-epsilon ||z||): a uniform direction (a normalised Gaussian) times a norm
    drawn from Gamma(d, 1/epsilon), here exactly as the sum of d Exp(1) draws over epsilon. The
    released embedding is then epsilon d(x, x')-private for tokens x, x' (d: the Euclidean distance
    of their embeddings): metric DP, not (epsilon, delta)-DP."""
    shape, device = embeddings.shape, embeddings.device
    gaussian = torch.randn(shape, generator=generator, device=device, dtype=torch.float64)
    direction = torch.nn.functional.normalize(gaussian, dim=-1)
    uniform = 1 - torch.rand(shape, generator=generator, device=device, dtype=torch.float64)  # in (0, 1]
    norm = -uniform.log().sum(-1, keepdim=True) / epsilon
    return (direction * norm).to(embeddings.dtype)


def token_distances(client: nn.Module, vocabulary: int, epsilon: float, releases: int) -> dict[str, float]:
    """What `dchi:epsilon` promises on the client part's token embedding table (its nn.Embedding of
    `vocabulary` rows): the distance from each token to its nearest neighbour (smallest and median
    over the tokens) and epsilon times the median, per release and over `releases` releases: the
    privacy loss between a typical token and the one nearest to it."""
    table = (
        next(m.weight for m in client.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == vocabulary)
        .detach()
        .double()
    )
    distance = torch.cdist(table, table).fill_diagonal_(math.inf).min(1).values
    median = float(distance.median())
    return {
        "nearest_token_distance_min": float(distance.min()),
        "nearest_token_distance_median": median,
        "epsilon_nearest_tokens": epsilon * median,
        "epsilon_nearest_tokens_over_run": epsilon * median * releases,
    }


def keep_probability(epsilon: float, classes: int) -> float:
    """Randomised response's probability of sending the true label: e^E / (e^E + K - 1), so that
    any two labels give any output with probabilities at most e^E apart (E-label-DP)."""
    return 1.0 / (1.0 + (classes - 1) * math.exp(-epsilon))


def marvell_noise(
    grad: torch.Tensor, labels: torch.Tensor, level: MarvellLevel, generator: torch.Generator | None
) -> torch.Tensor:
    """Marvell's noise for a batch of cut gradients with binary labels (1 positive, 0 negative).

    As the paper's reference code: the two classes' gradients are modelled as N(mean_k, var_k I)
    with var_k the batch's mean per-coordinate variance of class k, p is the batch's fraction of
    positives and the budget P = scale x ||g||^2, g the difference of the class means, the scale
    fixed (`marvell:S`) or the smallest whose optimum's sumKL meets the bound (`marvell:kl=K`). Each class
    gets noise N(0, Sigma_k) with Sigma_k = dir_k gg^T/||g||^2 + iso_k (I - gg^T/||g||^2), the
    form of the optimum (the paper's Theorem 2), the four variances from `marvell_variances`.
    A batch of one class has no class difference to shape the noise by: it gets isotropic noise
    of power scale x ||batch mean gradient||^2, scale 1 with `kl=K` (no KL between classes to
    bound; 1 is where the reference's dynamic mode starts): a simplification, the paper does not say."""
    flat = grad.flatten(1).double()
    positive = labels.reshape(-1) == 1
    z = torch.randn(flat.shape, generator=generator, device=flat.device, dtype=flat.dtype)
    w = torch.randn(flat.shape[:1], generator=generator, device=flat.device, dtype=flat.dtype)
    d = flat.shape[1]
    if bool(positive.all()) or not bool(positive.any()):
        power = (1.0 if level.kl else level.value) * float(flat.mean(0).square().sum())
        return (z * math.sqrt(power / d)).view(grad.shape).to(grad.dtype)
    pos, neg = flat[positive], flat[~positive]
    diff = pos.mean(0) - neg.mean(0)
    distance2 = float(diff.square().sum())
    if distance2 == 0:
        return torch.zeros_like(grad)
    u, v = float(neg.var(0, unbiased=False).mean()), float(pos.var(0, unbiased=False).mean())
    p = float(positive.double().mean())
    scale = marvell_kl_scale(u, v, d, distance2, p, level.value) if level.kl else level.value
    neg_dir, neg_iso, pos_dir, pos_iso = marvell_variances(u, v, d, distance2, p, scale * distance2)
    unit = diff / math.sqrt(distance2)
    along = z @ unit
    iso = torch.where(positive, pos_iso, neg_iso).sqrt()
    direction = torch.where(positive, pos_dir, neg_dir).sqrt()
    noise = (z - along[:, None] * unit) * iso[:, None] + (w * direction)[:, None] * unit
    return noise.view(grad.shape).to(grad.dtype)


def marvell_variances(u: float, v: float, d: int, g: float, p: float, power: float) -> tuple[float, ...]:
    """Marvell's optimisation (Li et al. 2022, Section 4): the noise variances (negatives along g,
    negatives per orthogonal direction, positives along g, positives per orthogonal direction)
    that minimise the symmetrised KL divergence between N(mean_1, v I + Sigma_1) and
    N(mean_0, u I + Sigma_0), i.e. (up to constants)

        (d-1) (a2/b2 + b2/a2) + (b1 + g)/a1 + (a1 + g)/b1,  a = v + positives', b = u + negatives',

    subject to p tr(Sigma_1) + (1-p) tr(Sigma_0) <= power, with g = ||mean_1 - mean_0||^2.

    The orthogonal directions only need their two variances equal: the cheapest way there (noise
    on the class with the smaller variance) is in closed form for a given share of the budget. What
    remains are two scalars, that share and how the direction's budget splits between the classes;
    the paper's reference code solves the KKT conditions case by case, here a grid over both,
    refined around its best point, finds the same minimum to a relative 1e-6 (tested against a
    general-purpose solver)."""
    orthogonal = d - 1
    smaller = (1 - p) if u < v else p  # the weight of the class whose variance is the smaller
    equalise = orthogonal * smaller * abs(v - u)  # what equal orthogonal variances cost

    def variances(share: Any, split: Any) -> tuple[Any, Any, Any, Any]:
        """(negatives along g, negatives across, positives along g, positives across) when `share`
        of the budget goes across g and the positives get the fraction `split` of the rest."""
        across = share / (orthogonal * smaller) if equalise > 0 else 0 * share
        rest = power - share
        pos_dir, neg_dir = split * rest / p, (1 - split) * rest / (1 - p)
        return (neg_dir, across, pos_dir, 0 * across) if u < v else (neg_dir, 0 * across, pos_dir, across)

    def objective(share: Any, split: Any) -> Any:
        value = marvell_objective(variances(share, split), u, v, d, g)
        return np.where(np.isfinite(value), value, np.inf)

    low, high = np.array([0.0, 0.0]), np.array([min(power, equalise), 1.0])
    bounds = high.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(6):
            shares, splits = np.meshgrid(np.linspace(low[0], high[0], 65), np.linspace(low[1], high[1], 65))
            i = np.unravel_index(np.argmin(objective(shares, splits)), shares.shape)
            best, step = np.array([shares[i], splits[i]]), (high - low) / 64
            low, high = np.maximum(best - 2 * step, 0), np.minimum(best + 2 * step, bounds)
    return tuple(float(x) for x in variances(best[0], best[1]))


def marvell_objective(variances: tuple[Any, ...], u: float, v: float, d: int, g: float) -> Any:
    """Marvell's objective for the variances (negatives along g, negatives across, positives along
    g, positives across): (d-1) (a2/b2 + b2/a2) + (b1 + g)/a1 + (a1 + g)/b1 (`marvell_variances`);
    numpy arrays of variances give an array."""
    neg_dir, neg_iso, pos_dir, pos_iso = variances
    a1, b1, a2, b2 = v + pos_dir, u + neg_dir, v + pos_iso, u + neg_iso
    return (d - 1) * (a2 / b2 + b2 / a2) + (b1 + g) / a1 + (a1 + g) / b1


def marvell_sum_kl(variances: tuple[float, ...], u: float, v: float, d: int, g: float) -> float:
    """KL(N_1 || N_0) + KL(N_0 || N_1) of the two noised class Gaussians: (objective - 2d) / 2 (each
    KL is half of trace + mean term - d + log-determinant ratio; the two log-determinants cancel).
    The reference code bounds any attacker's detection error below by 1/2 - sqrt(sumKL)/4."""
    return (float(marvell_objective(variances, u, v, d, g)) - 2 * d) / 2


def marvell_kl_scale(u: float, v: float, d: int, g: float, p: float, bound: float) -> float:
    """The smallest power scale s (P = s g) whose Marvell optimum has sumKL at most `bound`
    (`marvell:kl=K`), to a relative KL_SCALE_TOLERANCE above it. The optimum's sumKL does not grow
    with the budget (more power can go equally to both classes along g, which lowers the mean term),
    so: 0 where the gradients already meet the bound, else doubling from 1 until the bound holds
    (up to KL_SCALE_LIMIT), then bisection. The paper's reference code (dynamic=True) starts at
    s = 1 and multiplies by 1.5 until it holds: never below 1, and up to 1.5 x the smallest above."""

    def meets(scale: float) -> bool:
        return marvell_sum_kl(marvell_variances(u, v, d, g, p, scale * g), u, v, d, g) <= bound

    if meets(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while high < KL_SCALE_LIMIT and not meets(high):
        low, high = high, 2 * high
    while high - low > KL_SCALE_TOLERANCE * high:
        middle = (low + high) / 2
        low, high = (low, middle) if meets(middle) else (middle, high)
    return high


def check_applies(config: Any, splits: bool) -> None:
    """Refuse privacy settings that would claim what no mechanism gives: a defense or `record=`
    where nothing crosses a cut, `noise_key=` where nothing is random."""
    defense = parse_defense(config.defense)
    if not splits and (config.defense != "none" or config.record):
        key = f"defense={config.defense}" if config.defense != "none" else f"record={config.record}"
        raise UserError(f"{key} does not apply to {config.algorithm}: nothing crosses a cut (use a split algorithm)")
    if config.noise_key is not None and not defense.random:
        raise UserError(
            "noise_key= applies to a randomised defense (noise, dp, gradnoise, marvell, label_dp, dchi), "
            f"not {config.defense!r}"
        )
    label_defenses = [name for name in ("marvell", "label_dp") if getattr(defense, name) is not None]
    if label_defenses and config.tail_cut is not None:
        raise UserError(
            f"defense={config.defense}: {label_defenses[0]} protects labels the server holds; in a U-shaped split "
            f"(cut=A,B) they never leave the client (use a vanilla cut)"
        )


def check_task(defense: Defense, value: str, dataset: str, task: str, classes: int) -> None:
    """Refuse a defense the dataset's task does not fit: Marvell is defined for binary
    classification (two class-conditional gradient distributions), d_chi-privacy for the token
    embeddings of a language model."""
    if defense.dchi is not None and task != "language":
        raise UserError(
            f"defense={value}: dchi noises a language model's token embeddings; {dataset} is not a language "
            "dataset (use noise:S or clip:C+dp:epsilon=E)"
        )
    if defense.marvell is not None and (task != "classification" or classes != 2):
        raise UserError(
            f"defense={value}: marvell needs a binary classification task; {dataset} has {classes} "
            f"{'classes' if task == 'classification' else 'tokens'} (use gradnoise:S)"
        )


def parse_defense(value: str) -> Defense:
    """`none` or `+`-joined items (clip:C, noise:S, dp:epsilon=E, gradnoise:S, nopeek:A, quantize:int8|fp16,
    topk:F, marvell[:S], marvell:kl=K, label_dp:E, dchi:E)."""
    if value == "none":
        return Defense()
    settings: dict[str, Any] = {}
    allowed = "none or +-joined " + ", ".join(ITEMS.values())
    for item in value.split("+"):
        name, _, arg = item.partition(":")
        if name not in ITEMS or name in settings:
            reason = "given twice" if name in settings else "unknown"
            raise UserError(f"invalid defense {value!r}: {reason} item {item!r}; expected {allowed}")
        settings[name] = _argument(name, arg, value)
    if "dp" in settings and ("clip" not in settings or "noise" in settings):
        raise UserError(f"invalid defense {value!r}: {ITEMS['dp']}")
    return Defense(**settings)


def _dp_target(arg: str, value: str) -> tuple[float, float]:
    """`epsilon=E[,delta=D]` -> (E, D)."""
    fields = dict(part.partition("=")[::2] for part in arg.split(","))
    try:
        target = float(fields.pop("epsilon")), float(fields.pop("delta", DELTA))
    except (KeyError, ValueError):
        target = (math.nan, math.nan)
    if fields or not (0 < target[0] < math.inf and 0 < target[1] < 1):
        raise UserError(f"invalid defense {value!r}: expected {ITEMS['dp']}")
    return target


def _marvell_level(arg: str, value: str) -> MarvellLevel:
    """`` (the default scale), `S` or `kl=K`."""
    if arg == "":
        return MarvellLevel(MARVELL_SCALE)
    try:
        number = float(arg.removeprefix("kl="))
    except ValueError:
        number = math.nan
    if not 0 < number < math.inf:
        raise UserError(f"invalid defense {value!r}: expected {ITEMS['marvell']}")
    return MarvellLevel(number, kl=arg.startswith("kl="))


def _argument(name: str, arg: str, value: str) -> float | str | tuple[float, float] | MarvellLevel:
    if name == "dp":
        return _dp_target(arg, value)
    if name == "marvell":
        return _marvell_level(arg, value)
    if name == "quantize":
        if arg not in ("int8", "fp16"):
            raise UserError(f"invalid defense {value!r}: expected {ITEMS[name]}")
        return arg
    try:
        number = float(arg)
    except ValueError:
        number = math.nan
    valid = {
        "clip": 0 < number < math.inf,
        "noise": 0 <= number <= NOISE_LIMIT,
        "gradnoise": 0 <= number <= NOISE_LIMIT,
        "nopeek": 0 <= number < math.inf,
        "topk": 0 < number <= 1,
        "label_dp": 0 < number < math.inf,
        "dchi": 0 < number < math.inf,
    }[name]
    if not valid:
        raise UserError(f"invalid defense {value!r}: expected {ITEMS[name]}")
    return number
