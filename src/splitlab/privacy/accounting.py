"""The differential privacy that clipping + Gaussian noise at the cut gives, and nothing more.

Adjacency and sensitivity: two datasets are neighbours when one sample's input is replaced
(replace-one, per sample). With `defense=clip:C+noise:S`, each release of a sample's smashed data
is clipped to L2 norm C and gets N(0, (S C)^2) noise per coordinate; two inputs of one sample give
activations at most 2C apart (L2 sensitivity 2C), so one release is the Gaussian mechanism with
noise multiplier sigma / sensitivity = S / 2, i.e. mu-GDP with mu = 2 / S. A sample leaves its
client at most once per local epoch per round (`rounds * local_epochs` releases; batches are
shuffled passes, not Poisson samples, so no amplification by sampling is claimed). The releases
compose exactly: `rounds * local_epochs` Gaussian mechanisms with noise multiplier m are mu-GDP
with mu = sqrt(count) / m (Dong, Roth and Su 2019), whose (epsilon, delta) curve has a closed form;
epsilon is solved on it, exact rather than bounded (a PLD accountant, e.g. Google's
`dp-accounting`, approximates the same curve from above; the tests check they agree to 1%; an
RDP bound is 5-8% looser).

`dp:epsilon=E,delta=D` calibrates S: the smallest noise multiplier whose composed releases are
(E, D)-DP under this accounting.

It covers each sample's smashed data as released, against anyone who receives it (the training
server, an observer of the uplink). It does NOT cover: the labels, which travel in the clear; the
client part's weights, uploaded for averaging and trained on the same samples; what the cut
gradients make of the client part, and so the later activations of other samples computed by it;
anything about a client's dataset as a whole (it is per sample); evaluation traffic; nor any
defense other than clip + noise (gradnoise, NoPeek, quantization and top-k give no formal bound).

Vertical runs (setting=vertical): every party clips and noises its own embedding with its own key,
so each party's releases are the mechanism above for its own features of a sample (the reported
epsilon, per party, the same for every party). A sample's whole row (every party's features at once)
is released P times per step, so its guarantee composes P times as many mechanisms
(`epsilon_all_parties`). With `labels_at=server` the labels never cross; with a labelled party they
go to the server in the clear, as in vanilla runs, unless `label_dp` randomises them there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from splitlab.config import RunConfig
from splitlab.privacy.defenses import DELTA, Defense, parse_defense

COVERS = (
    "each sample's smashed data as released at the cut (replace-one adjacency, L2 sensitivity 2C), "
    "against the training server and anyone else who receives it"
)
NOT_COVERED = (
    "the labels (sent in the clear); the client part's weights (uploaded for averaging); what the cut "
    "gradients make of the client part, and so other samples' later activations; client-level privacy; "
    "evaluation traffic"
)
PARTIES_SCOPE = (
    "epsilon is each party's, for its own features of one sample (its embedding is "
    "released once per step, noised with its own key); epsilon_all_parties covers a sample's whole row, "
    "every party's release composed"
)
SAMPLING = "shuffled passes over each client's data: no amplification by sampling claimed"


def releases(config: RunConfig) -> int:
    """An upper bound on how often one sample's smashed data leaves its client in a run."""
    return config.rounds * config.local_epochs


def gaussian_dp_delta(mu: float, eps: float) -> float:
    """The exact delta(eps) of mu-GDP (Dong, Roth and Su 2019, Corollary 2.13); `count` composed
    Gaussian mechanisms with noise multiplier m are exactly mu-GDP with mu = sqrt(count) / m. The
    second term in log space, so that a large eps does not overflow."""
    from scipy.stats import norm

    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps + norm.logcdf(-eps / mu - mu / 2)))


def epsilon(noise_multiplier: float, count: int, delta: float = DELTA) -> float:
    """Epsilon at `delta` of `count` composed Gaussian mechanisms with this noise multiplier: exact,
    from the closed form of the mu-GDP they are (a PLD accountant approximates the same curve from
    above, to its discretisation, and took 15 s at small multipliers)."""
    from scipy.optimize import brentq

    mu = math.sqrt(count) / noise_multiplier
    if gaussian_dp_delta(mu, 0.0) <= delta:
        return 0.0
    high = 1.0
    while gaussian_dp_delta(mu, high) > delta:  # delta(eps) falls with eps
        high *= 2
    return float(brentq(lambda eps: gaussian_dp_delta(mu, eps) - delta, 0.0, high, xtol=1e-12))


@functools.lru_cache
def calibrated_multiplier(target_epsilon: float, delta: float, count: int) -> float:
    """The noise multiplier whose `count` releases are exactly (target_epsilon, delta)-DP (solved
    on the closed form of Gaussian DP, as `epsilon` is)."""
    from scipy.optimize import brentq

    mu = brentq(lambda mu: gaussian_dp_delta(mu, target_epsilon) - delta, 1e-6, 1e3, xtol=1e-12)
    return math.sqrt(count) / mu


def run_defense(config: RunConfig) -> Defense:
    """The run's defense as applied: `dp:epsilon=E` becomes the calibrated `noise:S` (S = 2 x multiplier)."""
    defense = parse_defense(config.defense)
    if defense.dp is None:
        return defense
    target_epsilon, delta = defense.dp
    return dataclasses.replace(defense, noise=2 * calibrated_multiplier(target_epsilon, delta, releases(config)))


def privacy_summary(config: RunConfig, releasers: int = 1) -> dict[str, Any]:
    """The summary's `privacy` entry for a run with a defense: (epsilon, delta) where clip + noise
    apply, else a note that no guarantee does; and whose secret the noise is. `releasers`: how many
    parties release their own part of one sample, each a mechanism of its own (the run's setting
    says: splitlab.settings.Setting.releasers)."""
    if config.defense == "none":
        return {}
    defense = run_defense(config)
    key = (
        "noise_key= was set: the guarantee assumes that key stays secret from the server"
        if config.noise_key is not None
        else "each party's noise key is its own (OS secure generator), never sent or written where the server reads"
    )
    from splitlab.data import SEQUENCE_DATASETS

    stated = label_privacy(defense.label_dp, releases(config)) if defense.label_dp is not None else {}
    if defense.dchi is not None:
        stated["tokens"] = {
            "epsilon_per_token": defense.dchi,
            "guarantee": "metric DP (d_chi-privacy) of each token's embedding per release: outputs for tokens x, x' "
            "differ in probability by at most exp(epsilon d(x, x')), d the Euclidean distance of their embeddings in "
            "the client's current embedding table; not (epsilon, delta)-DP, and the targets are not covered",
            "releases_per_token": releases(config),
            "epsilon_per_token_over_run": defense.dchi * releases(config),
            "composition": "each pass over a sequence releases its tokens' embeddings again with fresh noise: over "
            "the run, epsilon_per_token_over_run x d(x, x') (an attacker links and averages the releases)",
        }
    if defense.clip is None or defense.noise == 0 or config.dataset in SEQUENCE_DATASETS:
        why = (
            "a language run's targets (the text shifted by one token) reach the server in the clear"
            if config.dataset in SEQUENCE_DATASETS
            else "no clip + noise defense"
        )
        why += ": no differential privacy guarantee"
        return {"privacy": {"epsilon": None, "why": why, **stated, **({"noise_key": key} if defense.random else {})}}
    count = releases(config)
    multiplier = defense.noise / 2  # sensitivity 2C under replacement of one sample's input, noise std S * C
    delta = defense.dp[1] if defense.dp is not None else DELTA
    parties = {}
    if releasers > 1:  # each party releases its own embedding of a sample: one mechanism each
        parties = {"per_party": PARTIES_SCOPE, "epsilon_all_parties": epsilon(multiplier, count * releasers, delta)}
    return {
        "privacy": {
            "epsilon": epsilon(multiplier, count, delta),
            **parties,
            "delta": delta,
            "noise_multiplier": multiplier,
            "noise": defense.noise,
            "releases_per_sample": count,
            "covers": COVERS,
            "not_covered": NOT_COVERED,
            "sampling": SAMPLING,
            "noise_key": key,
            "accountant": "exact: composed Gaussian mechanisms are mu-GDP (Dong, Roth and Su 2019)",
            **stated,
        }
    }


def label_privacy(epsilon_per_release: float, count: int) -> dict[str, Any]:
    """The summary's `labels` entry under `label_dp:E`: randomised response is exactly E-label-DP
    (delta 0) per release of a label; a label sent `count` times with fresh randomness composes to
    count x E (pure DP composes additively)."""
    return {
        "labels": {
            "epsilon_per_release": epsilon_per_release,
            "epsilon_per_label": count * epsilon_per_release,
            "delta": 0.0,
            "releases_per_label": count,
            "mechanism": "randomised response over the K classes: the true label with probability "
            "e^E / (e^E + K - 1), else a uniformly drawn other class",
            "covers": "each training sample's label as sent to the server, against the server and any observer "
            "(not the smashed data, nor what the cut gradients and the client part reveal of it; nor, in a "
            "vertical run, the test samples' labels the label holder sends for evaluation)",
        }
    }
