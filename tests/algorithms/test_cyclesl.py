"""The CycleSL family (Algorithm 1): the server step, the client gradient through the updated
server, the |D_k|-weighted pooled server task, byte counts from tensor shapes, checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    global_weights,
    max_abs_difference,
    node,
    personal_weights,
    quick,
    server_model,
    straight_and_resumed,
    sync_model,
    train,
)
from splitlab.algorithms.sglr import averaged_clients

CYCLES = ["cycle_psl", "cycle_sglr", "cycle_sfl", "cycle_ssl"]
WIDTH = 200 * 4  # bytes per sample of the MLP's cut-1 activations (200 float32)


def one_batch_config(**opt) -> dict:
    return quick(clients=1, train_subset=32, batch_size=32, **opt)


@pytest.mark.parametrize("opt", [dict(optimizer="sgd", lr=0.1), dict(optimizer="adam", lr=1e-3)], ids=["sgd", "adam"])
def test_cycle_sfl_one_client_is_a_server_step_then_a_client_step_through_the_updated_server(opt):
    config = one_batch_config(**opt)
    cycle = train(1, algorithm="cycle_sfl", **config)
    sfl_v2 = train(1, algorithm="sfl_v2", **config)

    # The manual two-step computation from the initial weights.
    blueprint = cycle.blueprint
    client, server = blueprint.new_split()
    x, y = next(iter(node(cycle, 0).batches(0)))
    server_optimizer, client_optimizer = blueprint.optimizer(server), blueprint.optimizer(client)
    features = client(x).detach().requires_grad_()
    F.cross_entropy(server(features), y).backward()
    server_optimizer.step()  # 1. the server step (SFL-V2's)
    for p in server.parameters():
        p.requires_grad_(False)
    F.cross_entropy(server(client(x)), y).backward()  # 2. the client step, through the new server
    client_optimizer.step()

    assert max_abs_difference(server_model(cycle).state_dict(), server_model(sfl_v2).state_dict()) <= 1e-6
    assert max_abs_difference(server_model(cycle).state_dict(), server.state_dict()) <= 1e-6
    assert max_abs_difference(sync_model(cycle).state_dict(), client.state_dict()) <= 1e-6
    if opt["optimizer"] == "sgd":  # SFL-V2's client used the old server: measurably different
        assert max_abs_difference(sync_model(cycle).state_dict(), sync_model(sfl_v2).state_dict()) > 1e-4


def test_server_task_pools_the_batches_and_weights_the_loss_by_client_size():
    config = quick(partition="dirichlet:0.5", optimizer="sgd", lr=0.1, server_batch_size=1000)
    cycle = train(1, algorithm="cycle_psl", **config)
    blueprint = cycle.blueprint
    client, server = blueprint.new_split()
    batches = [next(iter(node(cycle, c.id).batches(0))) for c in cycle.clients]
    features = torch.cat([client(x) for x, _ in batches]).detach()
    labels = torch.cat([y for _, y in batches])
    sizes = torch.cat([torch.full((len(y),), float(c.num_samples)) for c, (_, y) in zip(cycle.clients, batches)])
    assert len(set(sizes.tolist())) > 1

    def server_after(weights):
        model = blueprint.new_split()[1]
        optimizer = blueprint.optimizer(model)
        loss = (F.cross_entropy(model(features), labels, reduction="none") * weights).sum() / weights.sum()
        loss.backward()
        optimizer.step()
        return model.state_dict()

    weighted, unweighted = server_after(sizes), server_after(torch.ones_like(sizes))
    assert max_abs_difference(weighted, unweighted) > 1e-5
    assert max_abs_difference(server_model(cycle).state_dict(), weighted) <= 1e-6


def test_server_trains_server_epochs_over_resampled_batches():
    experiment = train(0, algorithm="cycle_sfl", **quick(server_epochs=3, server_batch_size=20))
    optimizer, calls = experiment.roles.server.optimizer("server_model"), []
    step = optimizer.step
    optimizer.step = lambda *args, **kwargs: (calls.append(1), step(*args, **kwargs))[1]
    experiment.algorithm.run_round(0, experiment.clients)
    pooled = sum(min(32, c.num_samples) for c in experiment.clients)
    assert len(calls) == 3 * math.ceil(pooled / 20)


@pytest.mark.parametrize("algorithm", CYCLES)
def test_bytes_per_round(algorithm):
    experiment = train(1, algorithm=algorithm, **quick(clients=4, local_epochs=3))
    sent = [min(32, c.num_samples) for c in experiment.clients]  # ONE batch each, whatever local_epochs
    client_bytes = sum(t.numel() * t.element_size() for t in experiment.blueprint.new_split()[0].state_dict().values())
    expected = {"smashed": sum(sent) * WIDTH, "labels": sum(sent) * 8, "cut_grad": sum(sent) * WIDTH}
    if algorithm == "cycle_sglr":
        chosen = averaged_clients(experiment.algorithm.ctx, 0, experiment.clients, 0.5)
        expected["cut_grad"] = sum(WIDTH if k in chosen else n * WIDTH for k, n in enumerate(sent))
    if algorithm == "cycle_sfl":
        expected["client_model_down"] = expected["client_model_up"] = 4 * client_bytes
    if algorithm == "cycle_ssl":
        expected["client_model_relay"] = 3 * client_bytes  # handed on from client 0 to 1, 2, 3
    assert experiment.ledger.state_dict() == expected


@pytest.mark.parametrize("algorithm", CYCLES)
def test_checkpoint_resumes_bit_for_bit(algorithm):
    config = quick(participation=0.67, optimizer="adam", server_epochs=2, server_batch_size=16)
    straight, resumed = straight_and_resumed(3, algorithm=algorithm, **config)
    if algorithm in ("cycle_sfl", "cycle_ssl"):
        assert max_abs_difference(global_weights(resumed), global_weights(straight)) == 0.0
    else:
        mine, theirs = personal_weights(resumed), personal_weights(straight)
        assert mine.keys() == theirs.keys()
        for k in theirs:
            assert max_abs_difference(mine[k], theirs[k]) == 0.0
        assert max_abs_difference(server_model(resumed).state_dict(), server_model(straight).state_dict()) == 0.0
