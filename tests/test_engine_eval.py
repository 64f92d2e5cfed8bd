"""Evaluation: the per-client (sample-wise) test split, evaluation of personal client models,
and rounds/GiB to a target accuracy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import client_model, quick, server_model, sync_model, train
from splitlab.engine import build, run
from splitlab.errors import UserError
from splitlab.loop import evaluate
from splitlab.metrics import classification_metrics
from splitlab.settings.horizontal import hold_out


def test_hold_out_is_sample_wise_seeded_and_keeps_a_training_sample():
    indices = [np.arange(0, 10), np.arange(10, 15), np.arange(15, 16), np.arange(16, 116)]
    train_idx, test_idx = hold_out(indices, 0.1, seed=0)
    assert [len(t) for t in test_idx] == [1, 1, 0, 10]  # n - max(1, int(0.9 n)), as LEAF
    for original, tr, te in zip(indices, train_idx, test_idx):
        assert sorted(np.concatenate([tr, te]).tolist()) == original.tolist()
        assert not set(tr) & set(te)
    again = hold_out(indices, 0.1, seed=0)[1]
    assert all(np.array_equal(a, b) for a, b in zip(test_idx, again))
    other = hold_out(indices, 0.1, seed=1)[1]
    assert any(not np.array_equal(a, b) for a, b in zip(test_idx, other))


def test_client_split_builds_clients_from_the_training_part():
    experiment = build(quick(test_split="client:0.2", clients=4))
    whole = build(quick(clients=4))
    for node, (held, _), full in zip(experiment.roles.clients, experiment.client_test, whole.clients):
        assert node.num_samples + len(held) == full.num_samples
        assert len(held) == full.num_samples - max(1, int(0.8 * full.num_samples))
        assert not {tuple(row) for row in node.x.flatten(1).tolist()} & {tuple(row) for row in held.flatten(1).tolist()}


@pytest.mark.parametrize("bad", ["client", "client:0", "client:1", "clients:0.1", "local"])
def test_bad_test_split_is_one_line_user_error(bad):
    with pytest.raises(UserError, match="test_split") as err:
        build(quick(test_split=bad))
    assert "\n" not in str(err.value)


def test_client_split_pools_every_clients_own_predictions():
    """A personal-model algorithm: each client's own part on its own held-out samples."""
    experiment = train(2, algorithm="psl", **quick(test_split="client:0.2", participation=1.0))
    per_client = []
    for client, (x, y) in zip(experiment.clients, experiment.client_test):
        with torch.no_grad():
            logits = server_model(experiment)(client_model(experiment, client.id)(x))
        per_client.append((logits, y))
    pooled = classification_metrics(torch.cat([z for z, _ in per_client]), torch.cat([y for _, y in per_client]))
    assert evaluate(experiment) == pytest.approx(pooled)
    sizes = [len(y) for _, y in per_client]
    accuracy = sum(float((z.argmax(1) == y).float().mean()) * n for (z, y), n in zip(per_client, sizes)) / sum(sizes)
    assert evaluate(experiment)["accuracy"] == pytest.approx(accuracy)  # = test-size-weighted mean


def test_global_test_set_averages_each_clients_own_model():
    experiment = train(1, algorithm="sglr", **quick(clients=3))
    data = experiment.data
    per_client = []
    for client in experiment.clients:
        with torch.no_grad():
            logits = server_model(experiment)(client_model(experiment, client.id)(data.test_x))
        per_client.append(classification_metrics(logits, data.test_y))
    assert len({m["accuracy"] for m in per_client} | {m["loss"] for m in per_client}) > 2  # models differ
    expected = {key: float(np.mean([m[key] for m in per_client])) for key in per_client[0]}
    assert evaluate(experiment) == pytest.approx(expected)


def test_one_global_model_under_client_split_is_that_model_on_the_pooled_held_out_samples():
    experiment = train(1, algorithm="sfl_v2", **quick(test_split="client:0.2"))
    x, y = (torch.cat(held) for held in zip(*experiment.client_test))
    with torch.no_grad():
        logits = server_model(experiment)(sync_model(experiment)(x))
    assert evaluate(experiment) == pytest.approx(classification_metrics(logits, y))


def test_summary_reports_rounds_to_target(tmp_path):
    summary = run(
        quick(algorithm="cycle_sfl", rounds=3, target_accuracy=0.01, test_split="client:0.1", out=str(tmp_path)),
        progress=False,
    )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds_to_target"] == 1 and summary["gib_to_target"] == rows[0]["comm_gib"]
    assert json.loads((tmp_path / "summary.json").read_text())["rounds_to_target"] == 1
    with pytest.raises(UserError, match="target_accuracy"):
        build(quick(target_accuracy=45))
