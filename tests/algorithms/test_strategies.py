"""FedProx, FedOpt and SCAFFOLD on the sync server's half (splitlab.strategies): each equal to two
rounds computed by hand in plain torch here; checkpointed exactly; refused in one line where they
do not apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import global_weights, max_abs_difference, node, quick, straight_and_resumed, train
from splitlab.engine import build
from splitlab.errors import UserError
from splitlab.loop import STREAM_SAMPLING, sample_clients
from splitlab.resolve import resolve_config
from splitlab.roles import random_stream

#: three clients of 100 samples, each one batch of all of them: a local epoch is one SGD step
HAND = quick(batch_size=128, local_epochs=3, optimizer="sgd", lr=0.1)
CLIENT_PART = ("fc1.1.weight", "fc1.1.bias")  # the mlp's client part at cut 1


def logits(w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The mlp, written out: flatten, 64 -> 200 -> 200 -> 10 with ReLUs."""
    h = F.relu(F.linear(x.flatten(1), w["fc1.1.weight"], w["fc1.1.bias"]))
    h = F.relu(F.linear(h, w["fc2.0.weight"], w["fc2.0.bias"]))
    return F.linear(h, w["out.weight"], w["out.bias"])


def gradient(w: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    leaves = {k: v.detach().clone().requires_grad_() for k, v in w.items()}
    F.cross_entropy(logits(leaves, x), y).backward()
    return {k: v.grad for k, v in leaves.items()}


def local_sgd(w, x, y, steps=3, lr=0.1, mu=0.0, prox=(), correction=None):
    """`steps` SGD steps on the client's whole batch: gradient + mu (w - w_start) on the `prox`
    tensors, + the SCAFFOLD `correction` (c - c_i) on all."""
    start, w = w, dict(w)
    for _ in range(steps):
        g = gradient(w, x, y)
        for k in w:
            step = g[k] + (mu * (w[k] - start[k]) if k in prox else 0)
            if correction is not None:
                step = step + correction[k]
            w[k] = w[k] - lr * step
    return w


def mean(states, alphas):
    return {k: sum(a * s[k] for a, s in zip(alphas, states)) for k in states[0]}


def data(experiment):
    return [(node(experiment, k).x, node(experiment, k).y) for k in range(3)]


def initial(config):
    return global_weights(train(0, **config))


@pytest.mark.parametrize("algorithm", ["fedavg", "sfl_v1"])
def test_fedprox_equals_two_rounds_by_hand(algorithm):
    """The proximal term reaches the client part only: sfl_v1's server copies train without it."""
    config = {**HAND, "algorithm": algorithm, "prox_mu": 2.0}
    experiment = train(2, **config)
    prox = None if algorithm == "fedavg" else CLIENT_PART
    w = initial(config)
    for _ in range(2):
        w = mean([local_sgd(w, x, y, mu=2.0, prox=prox or w.keys()) for x, y in data(experiment)], [1 / 3] * 3)
    assert max_abs_difference(global_weights(experiment), w) < 1e-5
    without = global_weights(train(2, **{**config, "prox_mu": 0}))
    assert max_abs_difference(without, w) > 1e-4  # mu matters: 10x the tolerance


def test_fedadam_equals_two_rounds_by_hand():
    lr, (beta1, beta2), tau = 0.05, (0.9, 0.99), 1e-3
    config = {**HAND, "algorithm": "fedavg", "server_opt": "adam", "server_opt_lr": lr, "server_opt_tau": tau}
    experiment = train(2, **config)
    x = initial(config)
    m = {k: torch.zeros_like(t) for k, t in x.items()}
    v = {k: torch.full_like(t, tau**2) for k, t in x.items()}
    for _ in range(2):
        delta = {k: t - x[k] for k, t in mean([local_sgd(x, *d) for d in data(experiment)], [1 / 3] * 3).items()}
        for k in x:
            m[k] = beta1 * m[k] + (1 - beta1) * delta[k]
            v[k] = beta2 * v[k] + (1 - beta2) * delta[k] ** 2
            x[k] = x[k] + lr * m[k] / (v[k].sqrt() + tau)
    assert max_abs_difference(global_weights(experiment), x) < 1e-5


def test_scaffold_equals_two_rounds_by_hand():
    """Option II with c = 1/N sum of c_i; the control variates cross as their own ledger kinds."""
    config = {**HAND, "algorithm": "fedavg", "scaffold": True}
    experiment = train(2, **config)
    x = initial(config)
    c = {k: torch.zeros_like(t) for k, t in x.items()}
    own = [dict(c) for _ in range(3)]
    for _ in range(2):
        trained, deltas = [], []
        for i, (features, labels) in enumerate(data(experiment)):
            y = local_sgd(x, features, labels, correction={k: c[k] - own[i][k] for k in c})
            updated = {k: own[i][k] - c[k] + (x[k] - y[k]) / (3 * 0.1) for k in c}
            deltas.append({k: updated[k] - own[i][k] for k in c})
            own[i] = updated
            trained.append(y)
        x = mean(trained, [1 / 3] * 3)
        c = {k: c[k] + sum(d[k] for d in deltas) / 3 for k in c}
    assert max_abs_difference(global_weights(experiment), x) < 1e-5
    assert max_abs_difference(experiment.roles.sync.control("client_model"), c) < 1e-4
    for i in range(3):
        assert max_abs_difference(node(experiment, i).local_terms.controls["client_model"], own[i]) < 1e-4
    model_bytes = sum(t.numel() * 4 for t in x.values())
    counted = experiment.ledger.bytes_by_kind
    assert counted["control_down"] == counted["control_up"] == counted["client_model_down"] == 2 * 3 * model_bytes


def test_scaffold_with_half_the_clients_a_round_equals_two_rounds_by_hand():
    """participation=0.5 of 4 clients: x moves to the sampled clients' |D_k|-weighted mean, c by 1/N
    (N = 4, every client) times their Delta c_i, and a client left out keeps its c_i. Seed 0 samples
    clients 2, 3 then 1, 3 (76 and 75 samples: unequal weights in the second round)."""
    config = {**HAND, "algorithm": "fedavg", "scaffold": True, "clients": 4, "participation": 0.5, "train_subset": 302}
    experiment = build(config)
    rounds = [sample_clients(experiment.clients, 0.5, random_stream(0, rnd, STREAM_SAMPLING)) for rnd in range(2)]
    assert [[client.id for client in sampled] for sampled in rounds] == [[2, 3], [1, 3]]
    x = {k: t.clone() for k, t in global_weights(experiment).items()}  # the global model before training
    for rnd, sampled in enumerate(rounds):
        experiment.algorithm.run_round(rnd, sampled)
    c = {k: torch.zeros_like(t) for k, t in x.items()}
    own = [dict(c) for _ in range(4)]
    for sampled in rounds:
        ids = [client.id for client in sampled]
        trained, deltas = [], []
        for i in ids:
            features, labels = node(experiment, i).x, node(experiment, i).y
            y = local_sgd(x, features, labels, correction={k: c[k] - own[i][k] for k in c})
            updated = {k: own[i][k] - c[k] + (x[k] - y[k]) / (3 * 0.1) for k in c}
            deltas.append({k: updated[k] - own[i][k] for k in c})
            own[i] = updated
            trained.append(y)
        sizes = [len(node(experiment, i).y) for i in ids]
        x = mean(trained, [size / sum(sizes) for size in sizes])
        c = {k: c[k] + sum(d[k] for d in deltas) / 4 for k in c}
    assert sizes == [76, 75]
    assert max_abs_difference(global_weights(experiment), x) < 1e-5
    assert max_abs_difference(experiment.roles.sync.control("client_model"), c) < 1e-4
    for i in range(4):  # client 0 never sampled: no control variate yet (zeros)
        held = node(experiment, i).local_terms.controls.get(
            "client_model", {k: torch.zeros_like(t) for k, t in c.items()}
        )
        assert max_abs_difference(held, own[i]) < 1e-4


@pytest.mark.parametrize(
    "extra",
    [
        {"algorithm": "sfl_v2", "server_opt": "yogi", "server_opt_lr": 0.01, "scaffold": True, "optimizer": "sgd"},
        {"algorithm": "cse_fsl", "server_opt": "avgm", "prox_mu": 0.1, "scaffold": True, "optimizer": "sgd"},
        {"algorithm": "splitgp", "prox_mu": 0.1},
    ],
)
def test_strategies_resume_exactly_and_are_the_same_through_bytes(extra):
    """The server optimizer's moments and the control variates (the server's and each client's) are
    checkpointed; every new message is bit for bit the same through the serialized transport."""
    straight, resumed = straight_and_resumed(3, **quick(**extra))
    a, b = global_weights(straight), global_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    serialized = global_weights(train(3, **quick(transport="serialized", **extra)))
    assert all(torch.equal(a[k], serialized[k]) for k in a)


@pytest.mark.parametrize(
    ("settings", "refusal"),
    [
        ({"algorithm": "psl", "prox_mu": 0.1}, "prox_mu=0.1 does not apply to algorithm=psl: every client keeps"),
        ({"algorithm": "sl", "scaffold": True}, "scaffold=true does not apply to algorithm=sl: one client part"),
        ({"algorithm": "centralized", "server_opt": "adam"}, "server_opt=adam does not apply to algorithm=central"),
        ({"algorithm": "splitgp", "prox_mu": 1, "server_opt_lr": 0.5}, "server_opt_lr=0.5 does not apply to algorith"),
        ({"algorithm": "fedavg", "scaffold": True}, "scaffold=true does not apply to algorithm=fedavg: SCAFFOLD's"),
        ({"server_opt": "adam", "server_opt_momentum": 0.5}, "server_opt_momentum=0.5 does not apply here"),
    ],
)
def test_a_strategy_where_it_does_not_hold_is_refused_in_one_line(settings, refusal):
    with pytest.raises(UserError, match=refusal):
        resolve_config(quick(**settings))
