"""vectorize=true: clients trained together over stacked weights equal one client at a time."""

from __future__ import annotations

import pytest
import torch

from helpers import global_weights, max_abs_difference, quick, straight_and_resumed, train
from splitlab.engine import build
from splitlab.errors import UserError

#: every algorithm that runs vectorize=true, with settings that make its rounds do all they can: CSE-FSL
#: and FSL-SAGE send every second step, and FSL-SAGE aligns its aux models after round 0 (a short
#: alignment), so that round 1's clients step on aux models of their own
ALGORITHMS = {
    "fedavg": {},
    "sfl_v1": {},
    "psl": {},
    "cse_fsl": dict(server_update_interval=2),
    "fsl_sage": dict(server_update_interval=2, align_epochs=1),
    "sfl_v2": {},
}

OPTIMIZERS = [
    dict(optimizer="sgd", lr=0.05),
    dict(optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=1e-3, max_grad_norm=0.5),
    dict(optimizer="adam", lr=1e-3),
    dict(optimizer="adamw", lr=1e-3, weight_decay=0.1),
]


def every_weight(experiment) -> dict[str, torch.Tensor]:
    """The sync server's global models, the server part and every client's own slots (PSL's
    client parts, FSL-SAGE's aux models)."""
    roles = experiment.roles
    weights = {f"sync.{slot}.{n}": t for slot, m in roles.sync.models.items() for n, t in m.state_dict().items()}
    server = roles.server.models.get("server_model", torch.nn.Module())  # FedAvg's has none
    weights |= {f"server.{n}": t for n, t in server.state_dict().items()}
    for node in roles.clients:
        for slot in node.keeps & node.models.keys():
            weights |= {f"{node.id}.{slot}.{n}": t for n, t in node.models[slot].state_dict().items()}
    return weights


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: "-".join(map(str, o.values())))
def test_vectorized_equals_one_client_at_a_time(algorithm, opt):
    # unequal clients (dirichlet), several steps each with a smaller last batch, and cohorts of 2
    # of the 5 clients: every padding and slicing path runs; PSL's clients continue their own
    # optimizers, unequal in steps, in round 1
    config = quick(algorithm=algorithm, clients=5, batch_size=16, partition="dirichlet:0.5", **opt)
    config |= ALGORITHMS[algorithm]
    alone = train(2, **config)
    together = train(2, vectorize=True, cohort_size=2, **config)
    weights = every_weight(alone)
    owner = "0" if algorithm == "psl" else "sync"  # whose client part (PSL: each client's own)
    initial = alone.roles.server.blueprint.initial_state("client_model")
    moved = {f"{owner}.client_model.{name}": t for name, t in initial.items()}
    assert max_abs_difference(moved, {name: weights[name] for name in moved}) > 1e-3  # training moved it
    assert every_weight(together).keys() == weights.keys()
    assert max_abs_difference(every_weight(together), weights) <= 1e-5
    # the ledger counts what every client's verbs would have sent, byte for byte
    assert together.ledger.bytes_by_kind == alone.ledger.bytes_by_kind
    assert together.ledger.bytes_by_client == alone.ledger.bytes_by_client
    # the same steps tracked (CSE-FSL's and FSL-SAGE's: the server's), their mean loss alike
    assert together.algorithm.steps == alone.algorithm.steps
    assert together.algorithm.pop_train_loss() == pytest.approx(alone.algorithm.pop_train_loss(), abs=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_vectorized_run_resumes_exactly(algorithm):
    config = quick(algorithm=algorithm, clients=4, participation=0.5, vectorize=True, optimizer="adam")
    straight, resumed = straight_and_resumed(3, **config | ALGORITHMS[algorithm])
    assert max_abs_difference(every_weight(straight), every_weight(resumed)) == 0


def test_vectorized_cohorts_of_any_size_agree():
    config = quick(algorithm="fedavg", clients=6, batch_size=16, partition="dirichlet:0.5", optimizer="sgd", lr=0.05)
    one_cohort = global_weights(train(1, vectorize=True, **config))
    one_each = global_weights(train(1, vectorize=True, cohort_size=1, **config))
    assert max_abs_difference(one_cohort, one_each) <= 1e-5


@pytest.mark.parametrize(
    "settings,said",
    [
        (
            dict(algorithm="sglr"),
            r"algorithm=sglr does not declare it \(supports_vectorize: cse_fsl, fedavg, fsl_sage, psl, sfl_v1 and "
            r"sfl_v2 do\)$",
        ),
        (
            dict(algorithm="sfl_v2", server_schedule="sequential"),
            "server_schedule=sequential trains one client at a time, each all its steps with the server$",
        ),
        (dict(algorithm="fedavg", transport="serialized"), "it needs transport=direct, not transport=serialized"),
        (dict(algorithm="sfl_v1", precision="bf16"), "it needs precision=fp32, not precision=bf16"),
        (dict(algorithm="fedavg", grad_accum=2), "it needs grad_accum=1, not grad_accum=2"),
        (dict(algorithm="fedavg", prox_mu=0.1), "it needs prox_mu=0, not prox_mu=0.1"),
        (dict(algorithm="fedavg", optimizer="sgd", scaffold=True), "it needs scaffold=false, not scaffold=true"),
        (dict(algorithm="sfl_v1", server_opt="adam"), "it needs server_opt=avg, not server_opt=adam"),
        (dict(algorithm="fedavg", clients=4, secure_aggregation=True), "it needs secure_aggregation=false"),
        (dict(algorithm="sfl_v1", max_grad_norm=1, clip_scope="global"), "it needs clip_scope=part"),
        (dict(algorithm="fedavg", keep_client_optimizer=True), "it needs keep_client_optimizer=false"),
        (dict(algorithm="fedavg", warmup_steps=3), "it needs warmup_steps=0, not warmup_steps=3"),
        (dict(algorithm="sfl_v1", lr_decay="cosine"), "it needs lr_decay=none, not lr_decay=cosine"),
    ],
)
def test_vectorize_is_refused_in_one_line_where_it_cannot_apply(settings, said):
    with pytest.raises(UserError, match=f"^vectorize=true does not apply here: {said}") as error:
        build(quick(vectorize=True, **settings))
    assert "\n" not in str(error.value)


def test_cohort_size_needs_vectorize():
    with pytest.raises(UserError, match="cohort_size is how many clients vectorize=true runs together"):
        build(quick(algorithm="fedavg", cohort_size=4))


def test_a_model_with_running_statistics_is_refused_when_the_run_is_built():
    with pytest.raises(UserError, match=r"^vectorize=true does not apply to this model: its layer .*BatchNorm2d"):
        build(quick(algorithm="fedavg", model="resnet18", vectorize=True))
