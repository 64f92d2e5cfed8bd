"""The differential privacy that clipping + Gaussian noise at the cut gives, and nothing more.

With `defense=clip:C+noise:S`, each release of a sample's smashed data is clipped to L2 norm C
and gets N(0, (S C)^2) noise per coordinate: a Gaussian mechanism on that sample's activations.
Two different inputs of one sample give activations at most 2C apart, so one release is the
Gaussian mechanism with noise multiplier S / 2 for replacing that sample's input. A sample is
released at most once per local epoch per round, so at most `rounds * local_epochs` times; those
releases are composed with the RDP accountant of Google's `dp-accounting` library, with no
amplification by sampling claimed (a conservative bound).

It does NOT cover: the labels, which travel in the clear; the client part's weights, uploaded for
averaging and trained on the same samples; the cut gradients' effect on what the client part
becomes; anything about a client's dataset as a whole (it is per sample); nor any defense other
than clip + noise (NoPeek, quantization and top-k give no formal guarantee).
"""

from __future__ import annotations

from typing import Any

from splitlab.config import RunConfig
from splitlab.privacy.defenses import parse_defense

DELTA = 1e-5


def releases(config: RunConfig) -> int:
    """An upper bound on how often one sample's smashed data leaves its client in a run."""
    return config.rounds * config.local_epochs


def epsilon(noise_multiplier: float, count: int, delta: float = DELTA) -> float:
    """Epsilon at `delta` of `count` composed Gaussian mechanisms with this noise multiplier (RDP)."""
    import dp_accounting
    from dp_accounting import rdp

    accountant = rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier), count)
    return float(accountant.get_epsilon(delta))


def privacy_summary(config: RunConfig) -> dict[str, Any]:
    """The summary's `privacy` entry for a run with a defense: (epsilon, delta) where clip + noise
    apply, else a note that no guarantee does."""
    defense = parse_defense(config.defense)
    if config.defense == "none":
        return {}
    if defense.clip is None or defense.noise == 0:
        return {"privacy": {"epsilon": None, "why": "no clip + noise defense: no differential privacy guarantee"}}
    count = releases(config)
    multiplier = defense.noise / 2  # sensitivity 2C under replacement of one sample's input, noise std S * C
    return {
        "privacy": {
            "epsilon": epsilon(multiplier, count),
            "delta": DELTA,
            "noise_multiplier": multiplier,
            "releases_per_sample": count,
            "covers": "each sample's smashed data, against anyone who sees it (replace-one, per sample)",
            "not_covered": "labels, the client part's uploaded weights, cut gradients, client-level privacy",
            "accountant": "RDP, dp-accounting",
        }
    }
