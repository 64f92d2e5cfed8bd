"""PSL and SGLR: exact reductions to SFL-V1, the |D_k|-weighted gradient mean, separate learning
rates, byte counts from tensor shapes, and checkpoints of the personal client parts."""

from __future__ import annotations

import math

import pytest
import torch

from helpers import (
    client_model,
    global_weights,
    max_abs_difference,
    personal_weights,
    quick,
    server_model,
    straight_and_resumed,
    sync_model,
    train,
)
from splitlab.algorithms.sglr import average_cut_grads, averaged_clients

SGD = dict(optimizer="sgd", lr=0.05)


def personal_model(experiment, client_id: int) -> dict[str, torch.Tensor]:
    """Client `client_id`'s whole model: its own client part and the server part."""
    return {name: t for state in experiment.algorithm.personal_model(client_id) for name, t in state.items()}


@pytest.mark.parametrize("opt,rounds", [(SGD, 2), (dict(optimizer="adam"), 1)], ids=["sgd", "adam"])
@pytest.mark.parametrize("cut", [1, 2])
def test_psl_with_one_client_equals_sfl_v1(opt, rounds, cut):
    # Adam over one round only: PSL's client optimizer lives on, SFL-V1's copy gets a fresh one.
    config = quick(clients=1, cut=cut, local_epochs=2, **opt)
    sfl_v1 = global_weights(train(rounds, algorithm="sfl_v1", **config))
    psl = personal_model(train(rounds, algorithm="psl", **config), 0)
    assert max_abs_difference(psl, global_weights(train(0, algorithm="sfl_v1", **config))) > 1e-3
    assert max_abs_difference(psl, sfl_v1) <= 1e-6


def test_psl_first_round_matches_sfl_v1_then_clients_stay_personal():
    """Round 1 starts every client from the same weights, so PSL's averaged server part is SFL-V1's
    and the |D_k|-weighted mean of its client parts is SFL-V1's client part; afterwards not."""
    config = quick(partition="dirichlet:0.5", optimizer="adam")
    sfl_v1, psl = train(1, algorithm="sfl_v1", **config), train(1, algorithm="psl", **config)
    server = server_model(psl).state_dict()
    assert max_abs_difference(server, server_model(sfl_v1).state_dict()) <= 1e-6
    alphas = psl.algorithm.ctx.weights(psl.clients)
    mean = {
        name: sum(a * client_model(psl, c.id).state_dict()[name] for a, c in zip(alphas, psl.clients))
        for name in server.keys() ^ personal_model(psl, 0).keys()
    }
    assert max_abs_difference(mean, sync_model(sfl_v1).state_dict()) <= 1e-6
    clients = [client_model(psl, c.id).state_dict() for c in psl.clients]
    assert max_abs_difference(clients[0], clients[1]) > 1e-3


def test_sglr_without_averaging_is_psl():
    """One client: int(0.5 * 1) = 0 clients averaged, and with plain SGD the run-long server
    optimizer steps exactly like PSL's per-round copies."""
    config = quick(clients=1, **SGD)
    psl = personal_model(train(2, algorithm="psl", **config), 0)
    sglr = personal_model(train(2, algorithm="sglr", **config), 0)
    assert max_abs_difference(psl, sglr) <= 1e-6


def test_sglr_server_and_client_learning_rates_are_separate():
    """One full-data batch per client: the clients' step comes before the server's, so it does not
    depend on server_lr, and under SGD the server's displacement scales with server_lr."""
    config = quick(batch_size=300, **SGD)
    initial_server = {k: v.clone() for k, v in server_model(train(0, algorithm="sglr", **config)).state_dict().items()}
    runs = {lr: train(1, algorithm="sglr", server_lr=lr, **config) for lr in (0.05, 0.1)}
    moved = {
        lr: {k: v - initial_server[k] for k, v in server_model(run).state_dict().items()} for lr, run in runs.items()
    }
    assert max_abs_difference({k: 2 * v for k, v in moved[0.05].items()}, moved[0.1]) <= 1e-6
    for c in runs[0.05].clients:
        assert (
            max_abs_difference(client_model(runs[0.05], c.id).state_dict(), client_model(runs[0.1], c.id).state_dict())
            <= 1e-7
        )


def test_cut_gradient_mean_is_weighted_by_client_size():
    torch.manual_seed(0)
    grads = [torch.randn(3, 4), torch.randn(2, 4), torch.randn(5, 4)]
    sizes = [30, 10, 7]
    received = average_cut_grads(grads, sizes, averaged={0, 1})
    expected = (30 * grads[0].sum(0) + 10 * grads[1].sum(0)) / (30 * 3 + 10 * 2)
    assert received[0].shape == received[1].shape == (1, 4)
    assert torch.allclose(received[0][0], expected) and torch.equal(received[0], received[1])
    assert torch.equal(received[2], grads[2])


@pytest.mark.parametrize("fraction", [0.5, 1.0])
def test_sglr_bytes_per_round(fraction):
    config = quick(model="mlp", cut=1, clients=4, batch_size=32, local_epochs=2)
    experiment = train(1, algorithm="sglr", average_fraction=fraction, **config)
    sizes = [c.num_samples for c in experiment.clients]
    width = 200 * 4  # the MLP's cut-1 activations: 200 float32 per sample
    averaged = int(fraction * len(sizes))
    steps = [2 * math.ceil(n / 32) for n in sizes]
    ledger = experiment.ledger.state_dict()
    assert ledger["smashed"] == 2 * sum(sizes) * width
    assert ledger["labels"] == 2 * sum(sizes) * 8
    chosen = averaged_clients(experiment.algorithm.ctx, 0, experiment.clients, fraction)
    assert len(chosen) == averaged
    expected = sum(steps[k] * width if k in chosen else 2 * sizes[k] * width for k in range(len(sizes)))
    assert ledger["cut_grad"] == expected
    assert set(ledger) == {"smashed", "labels", "cut_grad"}


def test_psl_bytes_per_round():
    experiment = train(1, algorithm="psl", **quick(local_epochs=2))
    total = 2 * sum(c.num_samples for c in experiment.clients)
    assert experiment.ledger.state_dict() == {
        "smashed": total * 200 * 4,
        "labels": total * 8,
        "cut_grad": total * 200 * 4,
    }


@pytest.mark.parametrize("algorithm", ["psl", "sglr"])
def test_checkpoint_holds_the_personal_parts(algorithm):
    config = quick(participation=0.67, optimizer="adam")
    straight, resumed = straight_and_resumed(3, algorithm=algorithm, **config)
    mine, theirs = personal_weights(resumed), personal_weights(straight)
    assert mine.keys() == theirs.keys() and len(theirs) > 0
    for k in theirs:
        assert max_abs_difference(personal_model(resumed, k), personal_model(straight, k)) == 0.0
