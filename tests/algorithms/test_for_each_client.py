"""Algorithm.for_each_client: independent clients train at once where the transport allows it, and
are folded, with their tracked losses, in client order (so sums are added as in process)."""

from __future__ import annotations

import threading

import pytest
import torch

from splitlab.algorithms.base import Algorithm, ClientInfo, Context
from splitlab.resolve import resolve_config

CLIENTS = [ClientInfo(k, 10 * (k + 1)) for k in range(5)]


def algorithm(concurrency: int) -> Algorithm:
    config = resolve_config({"algorithm": "fedavg", "batch_size": 8})  # 2 to 7 local steps
    ctx = Context(config.run, config.params, CLIENTS, {}, None, None, concurrency)  # type: ignore[arg-type]
    return Algorithm(ctx)


def test_clients_train_at_once_and_fold_in_client_order():
    """Clients 0 and 1 must be inside `train` together to pass the barrier (it breaks if they run
    one after another), and client 0 ends after client 1; yet folds, each with the losses tracked
    so far, come in client order."""
    alg = algorithm(concurrency=2)
    together, one_done = threading.Barrier(2, timeout=60), threading.Event()
    events: list[tuple] = []

    def train(client: ClientInfo) -> None:
        if client.id < 2:
            together.wait()
        if client.id == 0:
            assert one_done.wait(timeout=60)
        alg.track(torch.tensor(float(client.id)))
        events.append(("trained", client.id))
        if client.id == 1:
            one_done.set()

    def fold(client: ClientInfo, alpha: float) -> None:
        events.append(("fold", client.id, alpha, alg._loss_count))

    alg.for_each_client(CLIENTS, train, fold)
    assert events.index(("trained", 1)) < events.index(("trained", 0))
    total = sum(c.num_samples for c in CLIENTS)
    assert [e for e in events if e[0] == "fold"] == [("fold", c.id, c.num_samples / total, c.id + 1) for c in CLIENTS]
    assert alg.pop_train_loss() == sum(range(5)) / 5


def test_in_process_clients_go_one_after_another():
    alg = algorithm(concurrency=1)
    events: list[tuple] = []
    alg.for_each_client(CLIENTS, lambda c: events.append(("train", c.id)), lambda c, a: events.append(("fold", c.id)))
    assert events == [(step, c.id) for c in CLIENTS for step in ("train", "fold")]


def test_interleaved_steps_run_clients_at_once_and_come_in_the_interleaved_order():
    """Every client's steps in a thread of its own (clients 0 and 1 meet at the barrier in their first
    step), the results handed out in exactly the in-process (interleaved) order."""
    together = threading.Barrier(2, timeout=60)

    def step(client: ClientInfo, i: int) -> dict:
        if client.id < 2 and i == 0:
            together.wait()
        return {"client": client.id, "step": i}

    alg = algorithm(concurrency=2)
    in_process = [(c.id, r) for c, r in algorithm(concurrency=1).interleaved_steps(0, CLIENTS, step_alone)]
    assert [(c.id, r) for c, r in alg.interleaved_steps(0, CLIENTS, step)] == in_process
    assert [(r["client"], r["step"]) for _, r in in_process] == [
        (CLIENTS[k].id, i) for k, i in alg.ctx.interleaved(0, CLIENTS)
    ]


def step_alone(client: ClientInfo, i: int) -> dict:
    return {"client": client.id, "step": i}


def test_an_error_in_a_client_s_thread_is_raised_in_the_driver():
    def step(client: ClientInfo, i: int) -> dict:
        if client.id == 3:
            raise RuntimeError("client 3 failed")
        return {}

    with pytest.raises(RuntimeError, match="client 3 failed"):
        list(algorithm(concurrency=2).interleaved_steps(0, CLIENTS, step))
