"""Every algorithm `splitlab algorithms` lists leaves the model a user would deploy, in one layout:
`weights.safetensors` (the global model, or the shared server part where clients keep their own)
and, where the algorithm personalises, `clients.safetensors` (`client.<k>.<name>`). Read back
from disk alone, the model evaluates to exactly the metrics the run reported."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from splitlab import catalog
from splitlab.algorithms import get_algorithm
from splitlab.engine import run
from splitlab.finished_run import final_states, load_run
from splitlab.metrics import classification_metrics, logits_in_batches

ALGORITHMS = [row[0] for row in catalog.load()["algorithms"]]
PERSONAL = {"psl", "sglr", "cycle_psl", "cycle_sglr", "splitgp"}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_model_files_reproduce_the_reported_metrics(tmp_path, algorithm):
    out = tmp_path / algorithm
    config = dict(
        algorithm=algorithm, dataset="digits", model="mlp", clients=2, rounds=1, train_subset=200,
        test_subset=100, batch_size=32, device="cpu", out=str(out),
    )  # fmt: skip
    summary = run(config, progress=False)
    weights = load_file(out / "weights.safetensors")
    assert weights and all(t.isfinite().all() for t in weights.values())
    assert (out / "clients.safetensors").is_file() == (algorithm in PERSONAL)
    if get_algorithm(algorithm).personal_models:
        clients = load_file(out / "clients.safetensors")
        assert {name.split(".")[1] for name in clients} == {"0", "1"}
        assert not set(weights) & {name.split(".", 2)[2] for name in clients}  # server part and client parts
    experiment = load_run(out)  # a fresh build; only the files' weights are trained
    deployed = experiment.clients if get_algorithm(algorithm).personal_models else experiment.clients[:1]
    data = experiment.data
    metrics = [
        classification_metrics(
            logits_in_batches(experiment.assemble(final_states(experiment, c.id)), data.test_x, 64), data.test_y
        )
        for c in deployed
    ]
    assert sum(m["accuracy"] for m in metrics) / len(metrics) == pytest.approx(summary["final_accuracy"], abs=1e-12)
    assert sum(m["loss"] for m in metrics) / len(metrics) == pytest.approx(summary["final_loss"], rel=1e-5)
