"""Epsilon against the exact Gaussian-DP curve, computed here independently, and against Google's
PLD accountant (another library's way to the same number); `dp:epsilon=E` calibration; the
summary's coverage lines."""

from __future__ import annotations

import math

import pytest
from scipy.optimize import brentq

from splitlab.config import RunConfig
from splitlab.errors import UserError
from splitlab.privacy.accounting import epsilon, privacy_summary, run_defense
from splitlab.privacy.defenses import parse_defense


def gdp_epsilon(mu: float, delta: float) -> float:
    """Epsilon at `delta` of mu-GDP (Dong, Roth and Su 2019): delta(eps) = Phi(-eps/mu + mu/2) -
    e^eps Phi(-eps/mu - mu/2), with Phi from math.erfc (no code shared with splitlab)."""

    def phi(x: float) -> float:
        return 0.5 * math.erfc(-x / math.sqrt(2))

    return brentq(lambda eps: phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2) - delta, 0, 500)


def test_clip_1_noise_2_over_3_releases_is_within_1_percent_of_the_exact_gaussian_dp_epsilon():
    # replace-one adjacency: sensitivity 2C = 2, noise std S C = 2 -> each release is 1-GDP; 3 releases: sqrt(3)-GDP
    summary = privacy_summary(RunConfig(algorithm="sfl_v2", rounds=3, local_epochs=1, defense="clip:1+noise:2"))
    privacy = summary["privacy"]
    assert privacy["delta"] == 1e-5 and privacy["releases_per_sample"] == 3
    assert privacy["epsilon"] == pytest.approx(gdp_epsilon(math.sqrt(3) * 2 / 2, 1e-5), rel=1e-9)
    assert "exact" in privacy["accountant"] and "no amplification" in privacy["sampling"]
    assert "client part's weights" in privacy["not_covered"] and "later activations" in privacy["not_covered"]


@pytest.mark.parametrize(("target", "delta", "rounds"), [(3.0, 1e-5, 3), (1.0, 1e-6, 10), (20.0, 1e-5, 2)])
def test_dp_epsilon_calibrates_the_noise_to_the_target(target, delta, rounds):
    config = RunConfig(algorithm="sfl_v2", rounds=rounds, defense=f"clip:1+dp:epsilon={target},delta={delta}")
    privacy = privacy_summary(config)["privacy"]
    assert privacy["epsilon"] == pytest.approx(target, rel=1e-6) and privacy["delta"] == delta
    sigma = run_defense(config).noise  # noise std per unit of clip, sensitivity 2
    assert gdp_epsilon(math.sqrt(rounds) * 2 / sigma, delta) == pytest.approx(target, rel=1e-3)


@pytest.mark.parametrize(("multiplier", "count", "delta"), [(1.0, 3, 1e-5), (0.25, 3, 1e-5), (2.0, 100, 1e-6)])
def test_epsilon_agrees_with_googles_pld_accountant_within_its_discretisation(multiplier, count, delta):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(multiplier), count)
    pld = accountant.get_epsilon(delta)
    assert epsilon(multiplier, count, delta) <= pld + 1e-9  # PLD's discretisation is pessimistic
    assert epsilon(multiplier, count, delta) == pytest.approx(pld, rel=0.01)


def test_epsilon_is_finite_for_tiny_noise_and_zero_when_delta_is_already_met():
    assert 0 < epsilon(0.025, 1000) < math.inf  # mu = 1265: e^eps would overflow outside log space
    assert epsilon(1e6, 1, 1e-5) == 0.0  # delta(0) = 2 Phi(mu / 2) - 1 = 4e-7 <= delta


@pytest.mark.parametrize(
    "value", ["dp:epsilon=1", "clip:1+noise:1+dp:epsilon=1", "clip:1+dp:eps=1", "clip:1+dp:epsilon=0"]
)
def test_bad_dp_targets_are_refused(value):
    with pytest.raises(UserError, match="dp:epsilon=<E > 0>"):
        parse_defense(value)
