"""Exact equivalences the math promises (cut-layer paper Prop. 1 and the one-client reductions)."""

from __future__ import annotations

import pytest

from helpers import global_weights, max_abs_difference, quick, train

CUTS = {"mlp": [1, 2], "cnn": [1, 2, 3]}
OPTIMIZERS = [dict(optimizer="sgd", lr=0.05), dict(optimizer="adam", lr=1e-3)]


@pytest.mark.parametrize("model", sorted(CUTS))
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o["optimizer"])
def test_sfl_v1_equals_fedavg_at_every_cut(model, opt):
    config = quick(model=model, partition="dirichlet:0.5", **opt)
    fedavg = global_weights(train(2, algorithm="fedavg", **config))
    initial = global_weights(train(0, algorithm="fedavg", **config))
    assert max_abs_difference(fedavg, initial) > 1e-3  # training moved the weights
    for cut in CUTS[model]:
        sfl_v1 = global_weights(train(2, algorithm="sfl_v1", cut=cut, **config))
        assert max_abs_difference(sfl_v1, fedavg) <= 1e-5, f"cut {cut}"


def test_sfl_v2_with_many_clients_is_not_fedavg():
    """The comparison above can tell algorithms apart."""
    config = quick(optimizer="sgd", lr=0.05)
    fedavg = global_weights(train(1, algorithm="fedavg", **config))
    sfl_v2 = global_weights(train(1, algorithm="sfl_v2", **config))
    assert max_abs_difference(fedavg, sfl_v2) > 1e-4


ONE_CLIENT = [("sfl_v2", {}), ("sfl_v2", {"server_schedule": "sequential"}), ("sl", {})]


@pytest.mark.parametrize("algorithm,extra", ONE_CLIENT, ids=["sfl_v2", "sfl_v2-sequential", "sl"])
@pytest.mark.parametrize("model", sorted(CUTS))
def test_one_client_equals_centralized(algorithm, extra, model):
    # Plain SGD over two rounds. Stateful optimizers over one round only: client optimizers start
    # afresh each round (their state is not averaged or relayed); the centralized one lives on.
    settings = [
        (dict(optimizer="sgd", lr=0.05), 2),
        (dict(optimizer="sgd", lr=0.05, momentum=0.5), 1),
        (dict(optimizer="adam"), 1),
    ]
    for opt, rounds in settings:
        config = quick(model=model, clients=1, local_epochs=2, **opt)
        reference = global_weights(train(rounds, algorithm="centralized", **config))
        for cut in CUTS[model]:
            split = global_weights(train(rounds, algorithm=algorithm, cut=cut, **extra, **config))
            assert max_abs_difference(split, reference) <= 1e-5, f"{opt['optimizer']} cut {cut}"
