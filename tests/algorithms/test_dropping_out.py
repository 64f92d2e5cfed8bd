"""Dropouts in every algorithm, in process (helpers.DropsOut does what a network does when a
client's process dies): the client is skipped for the rest of the round, the averages it would
have joined are renormalised over the clients that finished, its server copy is left out, and
when it rejoins it gets back the kept state it had at the last checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import DropsOut, quick
from splitlab.algorithms import get_algorithm
from splitlab.checkpoints import role_states
from splitlab.engine import build, run
from splitlab.roles import ModelAverage, TrainingServer, server_copy
from splitlab.transport import SerializedTransport

#: every algorithm: a client that drops out is skipped for the rest of the round
SKIPPING = [
    "sl",
    "cycle_ssl",
    "fedavg",
    "sfl_v1",
    "sfl_v2",
    "psl",
    "sglr",
    "cse_fsl",
    "fsl_sage",
    "splitgp",
    "cycle_psl",
    "cycle_sglr",
    "cycle_sfl",
]
#: whose round does not depend on the order clients take their steps in (not SplitFed-v2's interleaving)
ORDER_FREE = {"sl", "cycle_ssl", "fedavg", "sfl_v1", "psl", "sglr", "splitgp", "cycle_psl", "cycle_sglr", "cycle_sfl"}
#: the slots the sync server averages, and the algorithms with a server copy per client
AVERAGED = {"fedavg": {"client_model"}, "sfl_v1": {"client_model"}, "sfl_v2": {"client_model"}}
AVERAGED |= {"cycle_sfl": {"client_model"}, "fsl_sage": {"client_model"}}
AVERAGED |= {"cse_fsl": {"client_model", "aux_model"}, "splitgp": {"client_model", "aux_model"}}
SERVER_COPIES = {"sfl_v1", "psl", "splitgp"}
#: every client's cut gradients averaged: the subset does not depend on how many clients were sampled
SETTINGS = {"sglr": {"average_fraction": 1.0}, "cycle_sglr": {"average_fraction": 1.0}}
SMASHED_BATCH = 32 * 200 * 4  # one batch of the MLP's cut-1 activations, float32


def config(algorithm: str, **overrides) -> dict:
    return quick(algorithm=algorithm, train_subset=150, test_subset=100, **SETTINGS.get(algorithm, {}), **overrides)


def close(a, b) -> bool:
    """Two nests equal, their floating-point tensors up to rounding (a renormalised average
    divides a sum by the weights of those that finished; a round without the client normalises
    the weights first)."""
    if isinstance(a, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=0, atol=1e-6)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def without_client_2(algorithm: str):
    experiment = build(config(algorithm), SerializedTransport)
    experiment.algorithm.run_round(0, experiment.clients[:2])
    return experiment


@pytest.mark.parametrize("algorithm", SKIPPING)
def test_a_client_that_drops_out_before_training_counts_as_not_sampled(algorithm):
    dropped = build(config(algorithm), DropsOut.at_call(verbs=("begin_round",)))
    dropped.algorithm.run_round(0, dropped.clients)
    absent = without_client_2(algorithm)
    assert dropped.algorithm.dropped == {2}
    assert dropped.ledger.state_dict() == absent.ledger.state_dict()  # nothing of client 2 crossed
    if algorithm in ORDER_FREE:  # the same models (all roles, every client's kept state)
        states = [role_states(experiment) for experiment in (dropped, absent)]
        for state in states:  # client 2 holds the initial weights, whether received (SplitGP) or not
            del state["ledger"]
            state["clients"].pop(2, None)
        assert close(*states)


class Recording(DropsOut):
    """DropsOut, noting what goes into the sync server's averages and the server copies' average."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.added: dict[str, list[tuple[dict, float]]] = {}
        self.folded: list[tuple[int, float, dict]] = []
        self.left_out: list[int] = []

    def call(self, method, spec, counted, *args, **kwargs):
        role, name = getattr(method, "__self__", None), method.__name__
        if name == "add":
            self.added.setdefault(args[0], []).append((args[1], args[2]))
        elif name == "fold_copy":
            copy = role.models[server_copy(args[0])].state_dict()
            self.folded.append((args[0], args[1], {k: t.clone() for k, t in copy.items()}))
        elif name == "drop_copy":
            self.left_out.append(args[0])
        return super().call(method, spec, counted, *args, **kwargs)


def renormalised(contributions: list[tuple[dict, float]], like: dict) -> dict:
    average = ModelAverage()
    for state, alpha in contributions:
        average.add(state, alpha)
    average.incomplete = True
    return average.result(like)


@pytest.mark.parametrize("algorithm", SKIPPING)
def test_a_client_that_drops_out_mid_round_is_left_out_of_every_average(algorithm):
    at = 1 if algorithm.startswith("cycle") else 2  # a cycle's one forward, or the client's second step
    experiment = build(config(algorithm), Recording.at_call(at=at))
    record = experiment.transport
    experiment.algorithm.run_round(0, experiment.clients)
    assert experiment.algorithm.dropped == {2}
    alphas = experiment.algorithm.ctx.weights(experiment.clients)[:2]  # the weights of all three
    roles = experiment.roles
    assert set(record.added) == AVERAGED.get(algorithm, set())
    for slot, contributions in record.added.items():  # those of clients 0 and 1
        assert [alpha for _, alpha in contributions] == alphas
        model = roles.sync.model(slot).state_dict()
        assert all(torch.equal(model[k], t) for k, t in renormalised(contributions, model).items())
    if algorithm in SERVER_COPIES:  # those of 0 and 1; client 2's left out and freed
        assert [(k, alpha) for k, alpha, _ in record.folded] == list(zip([0, 1], alphas))
        assert record.left_out == [2]
        server = roles.server.model("server_model").state_dict()
        expected = renormalised([(copy, alpha) for _, alpha, copy in record.folded], server)
        assert all(torch.equal(server[k], t) for k, t in expected.items())
        assert not any(slot.startswith("server_copy@") for slot in roles.server.models)
    # client 2's smashed data stopped at the drop: the batches it sent before, and nothing after
    sent_before = 0 if algorithm == "fedavg" else at - 1
    smashed = experiment.ledger.state_dict().get("smashed", 0)
    assert smashed == without_client_2(algorithm).ledger.state_dict().get("smashed", 0) + sent_before * SMASHED_BATCH


def test_the_server_part_stays_as_it_was_when_every_client_drops_out():
    server = build(config("psl")).roles.server
    assert isinstance(server, TrainingServer)
    before = {k: t.clone() for k, t in server.model("server_model").state_dict().items()}
    server.copy_server(0)
    server.drop_copy(0)
    server.average_copies()
    assert all(torch.equal(before[k], t) for k, t in server.model("server_model").state_dict().items())


def rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def evaluated(rows: list[dict]) -> list[dict]:
    return [{k: row[k] for k in ("test_accuracy", "test_loss", "test_f1", "test_mcc")} for row in rows]


@pytest.mark.parametrize("algorithm", ["psl", "splitgp"])
def test_a_client_that_drops_mid_round_and_rejoins_trains_on_from_its_kept_state(tmp_path, algorithm):
    """Client 2 drops at its second step of round 1 and its node is lost. Nothing it did in that
    round is kept (its server copy and uploads are left out), and it rejoins with its kept slots
    as checkpointed after round 0: the models are bit for bit those of the run where it dropped
    out before training in round 1, and differ from those of the run where it never dropped out."""
    runs = {
        "mid_round": DropsOut.at_call(round=1, at=2),
        "before_training": DropsOut.at_call(round=1, verbs=("begin_round",)),
        "never": SerializedTransport,
    }
    for name, transport in runs.items():
        cfg = config(algorithm, rounds=3, checkpoint_every=0, out=str(tmp_path / name))
        run(cfg, progress=False, transport=transport)
    mid_round, before, never = (rows(tmp_path / name) for name in runs)
    assert evaluated(mid_round) == evaluated(before)
    assert evaluated(mid_round)[0] == evaluated(never)[0] and evaluated(mid_round)[1] != evaluated(never)[1]
    # what crossed: client 2's first batch of round 1 before it dropped, and its kept slots given
    # back once: the weights, and Adam's exp_avg, exp_avg_sq and float32 step count for each tensor
    ledger, ledger_before = mid_round[-1]["comm_bytes_by_kind"], before[-1]["comm_bytes_by_kind"]
    assert {k: ledger[k] - ledger_before[k] for k in ledger} == {
        **dict.fromkeys(ledger, 0),
        "smashed": SMASHED_BATCH,
        "labels": 32 * 8,
        "cut_grad": SMASHED_BATCH,
    }
    blueprint = build(config(algorithm)).blueprint
    kept = [p for slot in get_algorithm(algorithm).Client.keeps for p in blueprint.initial(slot).parameters()]
    assert ledger["kept_state_down"] == sum(3 * 4 * p.numel() + 4 for p in kept)
    if algorithm == "splitgp":  # every client's phi_k and h_k
        models = [load_file(tmp_path / name / "clients.safetensors") for name in ("mid_round", "before_training")]
        assert models[0].keys() == models[1].keys()
        assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


@pytest.mark.parametrize("algorithm", ["sl", "cycle_ssl"])
@pytest.mark.parametrize("client", [1, 2])
def test_a_holder_that_drops_out_takes_its_turn_with_it(tmp_path, algorithm, client):
    """Vanilla SL's one client part lives on the client holding it. Client 1 (2) drops out at the
    start of its turn, holding the part: client 2 (client 0 in the next round, and the evaluation)
    goes on from the part as the server relayed it to the dropped client, which the server sends
    (client_model_down): the models are those of the run where it dropped out before its turn."""
    runs = {"holding": DropsOut.TRAINING, "before": ("begin_round",)}
    for name, verbs in runs.items():
        cfg = config(algorithm, rounds=2, checkpoint_every=0, out=str(tmp_path / name))
        run(cfg, progress=False, transport=DropsOut.at_call(client=client, verbs=verbs))
    holding, before = (load_file(tmp_path / name / "weights.safetensors") for name in runs)
    assert holding.keys() == before.keys() and all(torch.equal(holding[k], before[k]) for k in before)
    part = build(config(algorithm)).blueprint.initial_state("client_model").values()
    sent = rows(tmp_path / "holding")[-1]["comm_bytes_by_kind"]["client_model_down"]
    assert sent == sum(t.numel() * t.element_size() for t in part)  # once
