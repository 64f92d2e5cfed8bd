"""CSE-FSL and FSL-SAGE: auxiliary models, alignment, byte counts, lazy mode, budget, resume.

Byte setup (as in test_bytes_per_round.py): synthetic data (1x8x8 inputs, 10 classes), 300 samples over 3
IID clients of 100, the MLP 64-200-200-10 in float32 cut after fc1. A client part is 13,000
parameters (52,000 bytes); per sample it sends 200 floats (800 bytes) and an int64 label (8 bytes).
The `linear` auxiliary model at cut 1 is Linear(200, 10): 2,010 parameters, 8,040 bytes.
With batch 32 and 2 local epochs a client takes 8 steps of 32, 32, 32, 4, 32, 32, 32, 4 samples;
with q = 3 it sends at steps 0, 3 and 6: 32 + 4 + 32 = 68 samples per client per round.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from safetensors.torch import load_file

from helpers import (
    client_model,
    crash_before_round,
    global_weights,
    max_abs_difference,
    node,
    quick,
    server_model,
    sync_model,
    train,
)
from splitlab.algorithms.fsl_sage import cut_gradient
from splitlab.engine import build, run
from splitlab.errors import UserError
from splitlab.io import read_jsonl
from splitlab.models import build_model, split
from splitlab.models.aux import AUX_KINDS, build_aux
from splitlab.models.staged import StagedModel
from splitlab.roles import STREAM_BATCHES
from splitlab.units import GIB

CLIENTS, CLIENT_PART, AUX_LINEAR = 3, 52_000, 8_040
SENT_SAMPLES = 3 * 68
BYTES = dict(batch_size=32, local_epochs=2, server_update_interval=3, aux="linear", cut=1)
MODEL_TRAFFIC = {"client_model_down": CLIENTS * CLIENT_PART, "client_model_up": CLIENTS * CLIENT_PART}
SAGE = {"fsl_sage": dict(align_interval=2)}
ACTIVATIONS = {"smashed": SENT_SAMPLES * 800, "labels": SENT_SAMPLES * 8}  # 163,200 and 1,632


def bytes_per_round(num_rounds: int, **config) -> list[dict[str, int]]:
    """The ledger's bytes by kind added in each round (all clients every round)."""
    experiment = build(quick(**{"clients": CLIENTS, **config}))
    ledger, rows, before = experiment.ledger, [], {}
    for rnd in range(num_rounds):
        experiment.algorithm.run_round(rnd, experiment.clients)
        after = ledger.state_dict()
        rows.append({k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)})
        before = after
    return rows


def test_cse_fsl_round_bytes_equal_the_hand_computation():
    expected = {
        **ACTIVATIONS,
        **MODEL_TRAFFIC,
        "aux_model_down": CLIENTS * AUX_LINEAR,
        "aux_model_up": CLIENTS * AUX_LINEAR,
    }
    assert bytes_per_round(2, algorithm="cse_fsl", **BYTES) == [expected, expected]


@pytest.mark.parametrize("lazy_until,aligned", [(None, [0, 2, 4]), (3, [0, 2]), (0, [])])
def test_fsl_sage_sends_aux_models_down_only_in_alignment_rounds(lazy_until, aligned):
    rows = bytes_per_round(5, algorithm="fsl_sage", align_interval=2, lazy_until=lazy_until, **BYTES)
    for rnd, row in enumerate(rows):
        aux = {"aux_model_down": CLIENTS * AUX_LINEAR} if rnd in aligned else {}
        assert row == {**ACTIVATIONS, **MODEL_TRAFFIC, **aux}, f"round {rnd}"


@pytest.mark.parametrize("algorithm", ["cse_fsl", "fsl_sage", "sfl_v2"])
def test_fsl_sage_ledger_convention_leaves_out_labels_only(algorithm):
    extra = {} if algorithm == "sfl_v2" else {**BYTES, "align_interval": 1} if algorithm == "fsl_sage" else BYTES
    ours = bytes_per_round(1, algorithm=algorithm, **extra)[0]
    theirs = bytes_per_round(1, algorithm=algorithm, ledger="fsl_sage", **extra)[0]
    assert ours.pop("labels") > 0
    assert theirs == ours


@pytest.mark.parametrize("algorithm", ["cse_fsl", "fsl_sage"])
def test_communication_budget_stops_after_the_round_that_reaches_it(tmp_path, algorithm):
    config = quick(algorithm=algorithm, clients=CLIENTS, **BYTES, **SAGE.get(algorithm, {}))
    per_round = [sum(row.values()) for row in bytes_per_round(3, **config)]
    # FSL-SAGE: rounds 0 and 2 carry aux models, round 1 does not; stop inside round 3's total
    budget = (per_round[0] + per_round[1] + per_round[2] / 2) / GIB
    summary = run({**config, "rounds": 10, "comm_budget_gib": budget, "out": str(tmp_path)}, progress=False)
    assert summary["stopped_by"] == "comm_budget" and summary["rounds_completed"] == 3
    assert summary["total_bytes"] == sum(per_round)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[-1]["round"] == 3 and rows[-1]["comm_bytes"] == sum(per_round)


def test_alignment_time_is_reported_in_the_metrics(tmp_path):
    run(quick(algorithm="fsl_sage", rounds=2, align_interval=2, out=str(tmp_path)), progress=False)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert set(rows[0]["round_compute_seconds"]) == {"client", "server", "alignment"}
    assert set(rows[1]["round_compute_seconds"]) == {"client", "server"}  # round 1 does not align


# --- what the algorithms compute ---------------------------------------------------------------------


@pytest.mark.parametrize("aux", ["linear", "stage"])
def test_alignment_brings_the_estimate_closer_to_the_true_cut_gradient(aux):
    experiment = train(0, **quick(algorithm="fsl_sage", aux=aux, align_interval=100, server_update_interval=1))
    server = experiment.roles.server
    for rnd in (1, 2):  # not alignment rounds: buffers fill, the server part moves away from the aux models
        experiment.algorithm.run_round(rnd, experiment.clients)
    for client in experiment.clients:
        before = server.estimation_error(client.id)
        server.align(3, client.id)
        after = server.estimation_error(client.id)
        assert after < 0.7 * before, (client.id, before, after)


def test_with_a_full_aux_model_the_first_step_is_splitfed_v2s():
    """aux=full starts as a copy of the server part, so the first estimate is the true cut gradient
    and one client with one batch per round trains exactly as SplitFed-v2. Over more steps the
    server part moves while the aux model stays until the next alignment (at most once a round),
    so the estimate and the truth part ways: the paper's algorithm gives no equality beyond that."""
    one_step = quick(clients=1, batch_size=300)
    sage = dict(algorithm="fsl_sage", server_update_interval=1, align_interval=1, aux="full")
    for opt in (dict(optimizer="sgd", lr=0.05), dict(optimizer="adam")):
        fsl_sage = global_weights(train(1, **one_step, **sage, **opt))
        sfl_v2 = global_weights(train(1, **one_step, algorithm="sfl_v2", **opt))
        assert max_abs_difference(fsl_sage, sfl_v2) == 0, opt["optimizer"]
        initial = global_weights(train(0, **one_step, algorithm="sfl_v2", **opt))
        assert max_abs_difference(fsl_sage, initial) > 1e-3  # the round did train

    many_steps = {**one_step, "batch_size": 32}
    fsl_sage = global_weights(train(1, **many_steps, **sage))
    sfl_v2 = global_weights(train(1, **many_steps, algorithm="sfl_v2"))
    assert max_abs_difference(fsl_sage, sfl_v2) > 1e-4


def test_the_initial_full_aux_estimate_is_the_true_cut_gradient():
    experiment = build(quick(algorithm="fsl_sage", aux="full"))
    x, y = node(experiment, 0).x[:50], node(experiment, 0).y[:50]
    smashed = sync_model(experiment)(x).detach()
    loss = experiment.blueprint.loss
    truth = cut_gradient(loss, server_model(experiment), smashed, y)
    for client in experiment.clients:
        assert torch.equal(cut_gradient(loss, client_model(experiment, client.id, "aux_model"), smashed, y), truth)
        assert torch.equal(cut_gradient(loss, experiment.roles.server.aux_model(client.id), smashed, y), truth)


def test_cse_fsl_never_sends_cut_gradients_and_trains():
    experiment = train(3, **quick(algorithm="cse_fsl", partition="dirichlet:0.5"))
    assert "cut_grad" not in experiment.ledger.state_dict()
    initial = global_weights(train(0, **quick(algorithm="cse_fsl")))
    assert max_abs_difference(global_weights(experiment), initial) > 1e-3


def test_alignment_buffer_keeps_the_latest_pairs():
    experiment = train(2, **quick(algorithm="fsl_sage", align_buffer_size=50, server_update_interval=1, batch_size=32))
    for client in experiment.clients:
        buffer = experiment.roles.server.buffers[client.id]
        assert len(buffer.labels) == len(buffer.smashed) == 50 and buffer.received == 2 * client.num_samples
        # with q = 1 every sample is sent: the buffer holds the last 50 samples of round 1's order
        last = experiment.blueprint.rng(1, STREAM_BATCHES, client.id, 0).permutation(client.num_samples)[-50:]
        assert sorted(buffer.labels.tolist()) == sorted(node(experiment, client.id).y[last].tolist())


@pytest.mark.parametrize("algorithm", ["cse_fsl", "fsl_sage"])
def test_interrupted_run_resumes_bit_for_bit(tmp_path, monkeypatch, algorithm):
    """Killed in round 2 (an alignment round), resumed from the checkpoint of round 1: aux models,
    alignment buffers and optimizers come back, so the run ends where the whole one does."""
    config = quick(
        algorithm=algorithm, rounds=3, partition="dirichlet:0.5", checkpoint_every=0, **SAGE.get(algorithm, {})
    )
    run({**config, "out": str(tmp_path / "whole")}, progress=False)
    crash_before_round(2, {**config, "out": str(tmp_path / "cut")}, monkeypatch)
    run({**config, "out": str(tmp_path / "cut"), "resume": True}, progress=False)
    rows = [
        [
            {k: v for k, v in row.items() if k not in ("wall_seconds", "round_compute_seconds")}
            for row in read_jsonl(tmp_path / name / "metrics.jsonl")
        ]
        for name in ("whole", "cut")
    ]
    assert rows[0] == rows[1]
    whole, cut = (load_file(tmp_path / name / "weights.safetensors") for name in ("whole", "cut"))
    assert all(torch.equal(whole[k], cut[k]) for k in whole)


# --- auxiliary models -----------------------------------------------------------------------------

SHAPES = {
    "mlp": (1, 8, 8),
    "cnn": (1, 28, 28),
    "splitgp_cnn": (1, 28, 28),
    "vgg11": (3, 32, 32),
    "resnet18": (3, 32, 32),
    "resnet50": (3, 32, 32),
}


def parameters(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_aux_kind_builds_for_every_cut_and_gives_logits(name):
    shape = SHAPES[name]
    model = build_model(name, shape, 10)  # build_aux copies what it takes: one model serves every call
    x = torch.randn(2, *shape)
    for cut in model.valid_cuts:
        client, server = split(model, cut)
        smashed = client.eval()(x)
        built = {kind: build_aux(kind, model, cut, shape).eval() for kind in AUX_KINDS}
        for kind, aux in built.items():  # in eval mode: running statistics, and so the weights, unchanged
            assert aux(smashed).shape == (2, 10), (cut, kind)
        sizes = {kind: parameters(aux) for kind, aux in built.items()}
        assert sizes["linear"] == min(sizes.values()) and sizes["full"] == parameters(server) == max(sizes.values())
        full = built["full"].state_dict()
        assert full.keys() == server.state_dict().keys()
        assert all(torch.equal(full[k], v) for k, v in server.state_dict().items())


def test_resnet18_aux_sizes_follow_the_paper_appendix_d4():
    """Cut after stage 2: linear = pool + fc (1,290 parameters, ~5 kB), stage = layer3 + pool + fc
    (2.10 M, ~8 MB), full = the server part (10.5 M, ~40 MB), half = layer3 and layer4 with one
    block each (4.60 M; the paper prints ~3.5 MB, which its own description does not give)."""
    sizes = {
        kind: parameters(build_aux(kind, build_model("resnet18", (3, 32, 32), 10), 2, (3, 32, 32)))
        for kind in AUX_KINDS
    }
    assert sizes == {"linear": 1_290, "half": 4_597_258, "stage": 2_102_282, "full": 10_498_570}
    half = build_aux("half", build_model("resnet18", (3, 32, 32), 10), 2, (3, 32, 32))
    assert [len(half.layer3), len(half.layer4)] == [1, 1]


def test_aux_errors_are_one_line_user_errors():
    with pytest.raises(UserError, match="unknown aux 'big'; available: linear, half, stage, full"):
        build_aux("big", build_model("mlp", (1, 8, 8), 10), 1, (1, 8, 8))
    with pytest.raises(
        UserError, match=r"invalid value 'big' for aux: .*'linear', 'half', 'stage', 'full' or 'blocks:N'"
    ):
        build(quick(algorithm="fsl_sage", aux="big"))
    grid = StagedModel(OrderedDict(a=torch.nn.Flatten(), b=torch.nn.Unflatten(1, (8, 8))))  # 8x8 "logits"
    with pytest.raises(UserError, match="aux=linear is not available for this model at cut 1: .*shape"):
        build_aux("linear", grid, 1, (1, 8, 8))
    with pytest.raises(UserError, match="lazy_until"):
        build(quick(algorithm="fsl_sage", lazy_until=-1))


def test_alignment_buffer_grows_then_overwrites_the_oldest_pair():
    """Pair n (in the order received) sits in slot n while the buffer grows, then in slot n mod
    capacity: every slot holds the latest pair sent to it, and the state holds only filled slots."""
    from splitlab.algorithms.fsl_sage import AlignmentBuffer

    buffer = AlignmentBuffer(7, torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64))
    sent = 0
    for chunk in (3, 1, 2, 5, 6, 4):
        numbers = torch.arange(sent, sent + chunk)
        buffer.add(numbers[:, None].float().repeat(1, 2), numbers)
        sent += chunk
        expected = [max(n for n in range(sent) if n % 7 == slot) for slot in range(min(sent, 7))]
        assert buffer.labels.tolist() == expected and buffer.received == sent
        assert buffer.smashed[:, 1].tolist() == expected
        state = buffer.state_dict()
        assert len(state["labels"]) == len(state["smashed"]) == min(sent, 7)
    buffer.add(torch.zeros(9, 2), torch.arange(100, 109))  # more than it holds: the last 7 stay
    assert sorted(buffer.labels.tolist()) == list(range(102, 109))
