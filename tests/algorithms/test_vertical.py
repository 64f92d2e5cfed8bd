"""Vertical split learning (setting=vertical): PSI alignment, training, equivalence with vanilla SL,
the ledger by hand, resume and transports, and one-line refusals."""

from __future__ import annotations

import csv
import inspect

import numpy as np
import pytest
import torch

from helpers import crash_before_round, max_abs_difference, straight_and_resumed, train
from splitlab import assembly, psi
from splitlab.algorithms import vertical_sl
from splitlab.algorithms.base import Algorithm
from splitlab.engine import build
from splitlab.errors import UserError
from splitlab.loop import evaluate
from splitlab.metrics import classification_metrics, logits_in_batches
from splitlab.roles import Role
from splitlab.settings.vertical import plan_vertical
from splitlab.transport import ClientDropped, Transport
from test_transport import ORCHESTRATION, ROLE_INTERNALS, attributes

TABLE = dict(setting="vertical", algorithm="sl", dataset="breast_cancer", model="mlp", device="cpu", seed=0)


def weights(experiment) -> list[torch.Tensor]:
    return [t for state in experiment.algorithm.global_model() for t in state.values()]


def test_two_parties_learn_breast_cancer_by_columns():
    experiment = train(3, **TABLE, combine="sum", batch_size=32)
    assert evaluate(experiment)["accuracy"] >= 0.9


def test_two_parties_learn_fashion_mnist_halves():
    experiment = train(
        1, **{**TABLE, "dataset": "fashion_mnist"}, train_subset=600, test_subset=500, batch_size=32, local_epochs=2
    )
    assert [p.x.shape[1:] for p in experiment.roles.clients] == [(1, 28, 14), (1, 28, 14)]
    assert evaluate(experiment)["accuracy"] >= 0.6


def test_one_party_with_every_feature_is_vanilla_sl_with_one_client():
    common = dict(algorithm="sl", dataset="digits", model="cnn", cut=1, device="cpu", train_subset=200)
    common.update(batch_size=32, optimizer="sgd", lr=0.05)  # vanilla SL's client optimizer restarts each round
    vertical = train(2, **common, setting="vertical", parties=1, labels_at=0)
    vanilla = train(2, **common, clients=1)
    assert max(float((a - b).abs().max()) for a, b in zip(weights(vertical), weights(vanilla), strict=True)) <= 1e-5
    assert vertical.ledger.state_dict() == vanilla.ledger.state_dict()


@pytest.mark.parametrize(
    ("labels_at", "transport", "dataset"),
    [
        ("server", "direct", "breast_cancer"),
        ("server", "serialized", "breast_cancer"),
        (0, "serialized", "breast_cancer"),
        (1, "direct", "fashion_mnist"),  # images: each party prepares its own columns of the test samples
    ],
)
def test_the_parties_evaluate_jointly_as_the_whole_model_on_every_column(monkeypatch, labels_at, transport, dataset):
    """The evaluation goes through the parties (each its bottom model on its own columns of the
    test samples, the top model on their combination, the metrics where the labels are): exactly
    the metrics of the whole model on every column of the test set, in the same batches. No
    party's model is fetched for it, the server holds no test feature, and nothing is counted."""
    images = dict(model="cnn", cut=1, train_subset=100, test_subset=300) if dataset == "fashion_mnist" else {}
    config = {**TABLE, "dataset": dataset, **images, "labels_at": labels_at, "transport": transport}
    experiment = train(2, **config, batch_size=32, local_steps=3)
    vertical = plan_vertical(experiment.config)
    whole = vertical_sl.VerticalAssembler(vertical.blueprint, vertical.plan)(experiment.algorithm.global_model())
    x, y = assembly.test_set(experiment.config, vertical.data, experiment.blueprint.device)
    expected = classification_metrics(logits_in_batches(whole, x, experiment.blueprint.inference_batch), y)
    before = experiment.ledger.state_dict()
    monkeypatch.setattr(vertical_sl.FeatureParty, "snapshot", None)  # no bottom model leaves its party
    assert evaluate(experiment) == expected
    assert experiment.ledger.state_dict() == before and len(experiment.data.test_x) == 0
    if dataset == "fashion_mnist":  # in two inference batches, as the whole model was run
        assert experiment.algorithm.server.test_batches() == [(0, 256), (256, 300)]


def test_psi_finds_exactly_the_common_ids():
    rng = np.random.default_rng(0)
    mine, theirs = np.sort(rng.choice(500, 120, replace=False)), np.sort(rng.choice(500, 200, replace=False))
    asker = psi.PsiAsker(mine)
    assert np.array_equal(asker.intersect(psi.answer(theirs, asker.request())), np.intersect1d(mine, theirs))


def write_table(path, rows: list[list[object]], header=("id", "f0", "f1", "f2", "f3", "label")) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)


@pytest.fixture
def table(tmp_path):
    """A CSV table of 60 rows with ids 1000 + 7i; party 0 (columns 0-1) misses rows 0-9, party 1
    (columns 2-3) rows 50-59, and the labels of rows 20-24 are unknown."""
    rng = np.random.default_rng(1)
    rows = []
    for i in range(60):
        label = i % 2
        cells = [round(float(v), 3) for v in rng.normal(label, 0.5, 4)]
        if i < 10:
            cells[0] = ""
        if i >= 50:
            cells[3] = ""
        rows.append([1000 + 7 * i, *cells, "" if 20 <= i < 25 else label])
    write_table(tmp_path / "train.csv", rows)
    write_table(tmp_path / "test.csv", [[i, *rng.normal(i % 2, 0.5, 4).round(3), i % 2] for i in range(20)])
    return tmp_path


@pytest.mark.parametrize("labels_at", ["server", 1])
def test_every_party_holds_exactly_the_intersection(table, labels_at):
    experiment = build(dict(TABLE, dataset="csv", data_dir=str(table), labels_at=labels_at, local_steps=1))
    truth = [1000 + 7 * i for i in range(10, 50) if not 20 <= i < 25]
    for party in experiment.roles.clients:
        assert party.ids.tolist() == truth and len(party.x) == len(truth)
    assert experiment.clients[0].num_samples == len(truth)
    assert experiment.partition_report["held_before_alignment"] == ([50, 50] if labels_at == "server" else [50, 45])


def test_the_ledger_counts_psi_and_each_party_bytes_as_computed_by_hand():
    n, batch, hidden = 455, 16, 200  # breast_cancer's 455 training rows; the MLP's first layer
    experiment = build(dict(TABLE, combine="sum", batch_size=batch, local_steps=1))
    # each party: the server's blinded ids (35 B each + 2) down, its own blinded once (35 B each
    # + 3) and the server's blinded again (35 B each) up; then the same the other way round
    per_party = (35 * n + 2) + (35 * n + 3) + 35 * n
    assert experiment.ledger.state_dict() == {"psi_up": 2 * per_party, "psi_down": 2 * per_party}
    experiment.algorithm.run_round(0, experiment.clients)
    embeddings = 2 * batch * hidden * 4  # two parties, float32
    assert experiment.ledger.state_dict() == {
        "psi_up": 2 * per_party,
        "psi_down": 2 * per_party,
        "smashed": embeddings,
        "cut_grad": embeddings,
    }
    # each party: its two intersections, its embedding up and the gradient at it down
    each = 2 * per_party + 2 * batch * hidden * 4
    assert experiment.ledger.bytes_by_client == {0: each, 1: each}
    labelled = build(dict(TABLE, labels_at=0, batch_size=batch, local_steps=1))
    labelled.algorithm.run_round(0, labelled.clients)
    assert labelled.ledger.state_dict()["labels"] == batch * 8
    assert labelled.ledger.state_dict()["psi_up"] == (35 * n + 2) + (35 * n + 3) + 35 * n + per_party
    # party 0 holds the labels: it exchanges both intersections with party 1 (through the server,
    # so each leg is its sender's or receiver's), and sends the labels on top
    assert labelled.ledger.bytes_by_client == {0: each + batch * 8, 1: each}


@pytest.mark.parametrize("combine", ["concat", "mean"])
def test_resume_and_serialized_transport_are_bit_identical(combine):
    config = dict(TABLE, combine=combine, batch_size=32, local_steps=3, train_subset=100)
    straight, resumed = straight_and_resumed(2, **config)
    assert (
        max_abs_difference(
            straight.full_state(straight.algorithm.global_model()), resumed.full_state(resumed.algorithm.global_model())
        )
        == 0
    )
    assert straight.ledger.state_dict() == resumed.ledger.state_dict()
    serialized = train(2, **config, transport="serialized")
    direct = train(2, **config)
    assert all(torch.equal(a, b) for a, b in zip(weights(serialized), weights(direct), strict=True))
    assert serialized.ledger.state_dict() == direct.ledger.state_dict()
    assert serialized.ledger.bytes_by_client == direct.ledger.bytes_by_client


def test_a_run_interrupted_and_resumed_from_its_checkpoint_ends_as_one_straight_run(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from splitlab.engine import run

    config = dict(TABLE, rounds=3, local_steps=2, checkpoint_every=0, labels_at=1)
    straight = run(dict(config, out=str(tmp_path / "straight")), progress=False)
    crash_before_round(2, dict(config, out=str(tmp_path / "resumed")), monkeypatch)
    resumed = run(dict(config, out=str(tmp_path / "resumed"), resume=True), progress=False)
    assert straight["comm_bytes_by_kind"] == resumed["comm_bytes_by_kind"] and straight["comm_bytes_by_kind"]["psi_up"]
    assert straight["comm_bytes_by_client"] == resumed["comm_bytes_by_client"]
    assert sum(straight["comm_bytes_by_client"].values()) == straight["total_bytes"]
    assert straight["final_loss"] == resumed["final_loss"]
    a, b = (load_file(tmp_path / name / "weights.safetensors") for name in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(features="0-9/9-29"), "column 9 is in party 0's group and party 1's"),
        (dict(features="0-9/"), "not a column index"),
        (dict(features="0-9/10-40"), "outside columns 0 to 29"),
        (dict(features="0-29"), "gives 1 groups"),
        (dict(labels_at=2), "labels_at=2 is not a party"),
        (dict(algorithm="sfl_v2"), "vertical SplitNN is algorithm=sl"),
        (dict(dataset="digits", model="cnn", combine="sum"), "combine=sum cannot join"),
        (dict(dataset="fashion_mnist", model="cnn", cut=2), "combine=concat cannot join"),
        (dict(parties=40), "parties=40 is more than the 30 feature columns"),
    ],
)
def test_bad_vertical_settings_get_one_line(settings, message):
    with pytest.raises(UserError, match=message) as error:
        build({**TABLE, **settings})
    assert "\n" not in str(error.value)


def test_parties_with_no_sample_in_common_and_other_ways_in_are_refused(tmp_path):
    rows = [[i, *(["", "", 1, 1] if i < 5 else [1, 1, "", ""]), i % 2] for i in range(10)]
    write_table(tmp_path / "train.csv", rows)
    write_table(tmp_path / "test.csv", [[i, 1, 1, 1, 1, i % 2] for i in range(4)])
    with pytest.raises(UserError, match="no sample in common"):
        build(dict(TABLE, dataset="csv", data_dir=str(tmp_path)))
    with pytest.raises(UserError, match="parties=3 does not apply here"):
        build(dict(TABLE, setting="vanilla", parties=3))


def test_vertical_classes_keep_to_their_side_of_the_boundary():
    classes = [
        obj for _, obj in inspect.getmembers(vertical_sl, inspect.isclass) if obj.__module__ == vertical_sl.__name__
    ]
    for cls in classes:
        if issubclass(cls, Algorithm):
            assert not attributes(cls) & ROLE_INTERNALS
        if issubclass(cls, Role):
            assert not attributes(cls) & ORCHESTRATION


class LeavesInRound(Transport):
    """In process, but party `who` leaves (ClientDropped) when asked for its embedding in round 1."""

    who = 1

    def call(self, method, spec, counted, *args, **kwargs):
        role = getattr(method, "__self__", None)
        if getattr(role, "id", None) == self.who and role.round == 1 and method.__name__ == "forward":
            raise ClientDropped(self.who, "left")
        return super().call(method, spec, counted, *args, **kwargs)


@pytest.mark.parametrize(("combine", "who", "steps"), [("concat", 1, 3), ("mean", 1, 3), ("sum", 0, 0)])
def test_a_party_that_drops_out_is_left_out_of_the_round(combine, who, steps):
    """Party 1 drops: the server trains on the other's embedding; the label holder (party 0) drops:
    no step is taken in that round."""
    config = dict(TABLE, combine=combine, labels_at=0, batch_size=64, local_steps=3, train_subset=200)
    experiment = build(config, type("Leaves", (LeavesInRound,), {"who": who}))
    experiment.algorithm.run_round(0, experiment.clients)
    before = experiment.ledger.state_dict()["smashed"]
    experiment.algorithm.run_round(1, experiment.clients)
    assert experiment.algorithm.dropped == {who}
    stayed = experiment.roles.clients[1 - who]
    assert experiment.ledger.state_dict()["smashed"] - before == steps * 64 * 200 * 4
    assert stayed.stash == {}
    assert (experiment.algorithm.pop_train_loss() is not None) or steps == 0


def test_a_passive_party_infers_labels_from_its_gradients(tmp_path):
    from splitlab.audit.run import attack_run
    from splitlab.engine import run

    run(dict(TABLE, labels_at=0, rounds=1, local_steps=5, out=str(tmp_path / "v")), progress=False)
    result = attack_run(tmp_path / "v", {"attack": "label_leak", "targets": 100})
    assert list(result["by_party"]) == [1] and result["samples"] == 100  # party 0 holds the labels
    assert result["direction_auc"] > 0.9  # binary labels: the gradient's direction gives them away
    with pytest.raises(UserError, match="attack=fsha is not offered for a vertical run; offered: inversion"):
        attack_run(tmp_path / "v", {"attack": "fsha"})


def test_a_csv_table_trains_horizontally_without_its_incomplete_rows(table, tmp_path):
    experiment = build(dict(dataset="csv", data_dir=str(table), model="mlp", clients=2, device="cpu", rounds=1))
    assert sum(c.num_samples for c in experiment.clients) == 60 - 10 - 10 - 5
    bad = tmp_path / "bad"
    bad.mkdir()
    write_table(bad / "train.csv", [[1, 2, 3, 4, 5, 0]])
    write_table(bad / "test.csv", [[1, 2, 3, 4, 5, 0]], header=("key", "f0", "f1", "f2", "f3", "label"))
    with pytest.raises(UserError, match="has no 'id' column"):
        build(dict(dataset="csv", data_dir=str(bad), model="mlp", clients=2, device="cpu"))


@pytest.mark.parametrize(("labels_at", "who"), [("server", 0), (1, 1)])
def test_a_party_that_rejoins_as_a_fresh_node_gets_its_state_and_is_aligned_again(table, labels_at, who):
    """What a `splitlab client` that reconnects builds (every row it holds, the initial weights)
    is given the party's kept state and narrowed again to the intersection by PSI (counted)."""
    from splitlab.settings.vertical import Vertical

    config = dict(TABLE, dataset="csv", data_dir=str(table), labels_at=labels_at, local_steps=1)
    experiment = build(config)
    experiment.algorithm.run_round(0, experiment.clients)
    experiment.algorithm.client_states()  # kept, as at a checkpoint
    party = experiment.roles.clients[who]
    ids, x, y = party.ids.copy(), party.x.clone(), party.y.clone()
    weights = {k: v.clone() for k, v in party.models["client_model"].state_dict().items()}
    vars(party).update(vars(Vertical().node_here(experiment.config, who)))  # the fresh node, unaligned
    assert len(party.ids) > len(ids)
    psi_before = experiment.ledger.state_dict()["psi_up"]
    experiment.algorithm.rejoined(who)
    assert party.ids.tolist() == ids.tolist() and torch.equal(party.x, x) and torch.equal(party.y, y)
    assert all(torch.equal(v, weights[k]) for k, v in party.models["client_model"].state_dict().items())
    assert experiment.ledger.state_dict()["psi_up"] > psi_before
