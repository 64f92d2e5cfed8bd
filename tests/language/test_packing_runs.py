"""packing=true in a run (issue 43): the training rows packed, their segment ids with each batch to
the client part and, with the smashed data (counted in the ledger), to the server part; the first
step's loss is the unpacked rows' loss; where the ids cannot reach, one line."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from helpers import global_weights, max_abs_difference, train
from hf_helpers import tiny_hf_model
from splitlab.errors import UserError
from splitlab.net.checks import Checks, Refused
from splitlab.roles import ClientNode
from splitlab.targets import IGNORED

ROWS = 20
#: renders a conversation as `<|role|>content<eos>`
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """A tiny random GPT-2 folder whose tokenizer has a chat template."""
    return tiny_hf_model(tmp_path_factory.mktemp("chat") / "gpt2", chat_template=CHAT_TEMPLATE)


def chat_file(tmp_path):
    """ROWS short conversations of different lengths."""
    path = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": "to be" * (1 + i % 3)},
                {"role": "assistant", "content": "or" * (1 + i % 2)},
            ]
        }
        for i in range(ROWS)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def config(tmp_path, folder, **overrides) -> dict:
    """One client, one step over every training row at once (so both runs see the same rows)."""
    settings = dict(
        algorithm="sfl_v2",
        dataset="jsonl",
        data_file=str(chat_file(tmp_path)),
        model="hf",
        model_dir=str(folder),
        seq_len=64,
        clients=1,
        batch_size=ROWS,
        local_steps=1,
        optimizer="sgd",
        lr=0.1,
        device="cpu",
    )
    return {key: value for key, value in {**settings, **overrides}.items() if value is not None}


def first_step_loss(experiment) -> float:
    losses: list[torch.Tensor] = []
    algorithm = experiment.algorithm
    track = algorithm.track
    algorithm.track = lambda loss, norm=None: losses.append(loss) or track(loss, norm)
    algorithm.run_round(0, experiment.clients)
    return float(losses[0])


def test_a_packed_first_step_loses_what_the_unpacked_rows_lose_by_hand(tmp_path, chat_model):
    packed_run = train(0, **config(tmp_path, chat_model, packing=True))
    client = packed_run.roles.clients[0]
    unpacked = train(0, **config(tmp_path, chat_model))
    rows_x, rows_y = unpacked.roles.clients[0].x, unpacked.roles.clients[0].y
    assert client.segments is not None and 2 * len(client.y) <= len(rows_y)  # two rows or more per sequence
    assert int((client.y != IGNORED).sum()) == int((rows_y != IGNORED).sum())  # every target kept
    # by hand: the initial model on the rows one a sequence, the mean over their targets in the loss
    client_part = unpacked.roles.clients[0].model("client_model")
    server_part = unpacked.roles.server.model("server_model")
    with torch.no_grad():
        logits = server_part(client_part(rows_x))
        by_hand = float(F.cross_entropy(logits.transpose(1, 2), rows_y, ignore_index=IGNORED))
    assert first_step_loss(packed_run) == pytest.approx(by_hand, abs=1e-5)
    assert first_step_loss(unpacked) == pytest.approx(by_hand, abs=1e-5)
    with torch.no_grad():  # the ids matter: the packed sequences run as one row each lose otherwise
        logits = server_part(client_part(client.x))
        as_one_row = float(F.cross_entropy(logits.transpose(1, 2), client.y, ignore_index=IGNORED))
    assert abs(as_one_row - by_hand) > 1e-3


def test_the_segment_ids_are_counted_and_the_same_through_bytes(tmp_path, chat_model):
    settings = config(tmp_path, chat_model, packing=True, batch_size=4, local_steps=3)
    direct = train(1, **settings)
    batches = [len(b) for b in direct.roles.clients[0].y.split(4)][:3]
    kinds = direct.ledger.state_dict()
    assert kinds["segments"] == sum(batches) * 64 * 8  # int64 (B, T) per step
    serialized = train(1, **dict(settings, transport="serialized"))
    assert max_abs_difference(global_weights(serialized), global_weights(direct)) == 0
    assert serialized.ledger.state_dict() == kinds


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(algorithm="splitgp"), "algorithm=splitgp"),
        (dict(tail_cut=2), "tail_cut"),
        (dict(grad_accum=2, batch_size=8), "grad_accum=1"),
        (dict(record=4), "record=0"),
        (dict(dataset="digits", data_file=None, model="mlp", model_dir=None, seq_len=None), "dataset=jsonl, hf_disk"),
    ],
)
def test_packing_where_the_ids_cannot_reach_is_one_line(tmp_path, chat_model, overrides, named):
    settings = config(tmp_path, chat_model, packing=True, **overrides)
    with pytest.raises(UserError, match=named) as refused:
        train(0, **settings)
    assert "\n" not in str(refused.value) and "packing" in str(refused.value)


def test_packing_text_rows_is_one_line(tmp_path, chat_model):
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": "to be or not to be " * 20}) + "\n" for i in range(ROWS)))
    with pytest.raises(UserError, match="rows are text") as refused:
        train(0, **dict(config(tmp_path, chat_model, packing=True), data_file=str(path)))
    assert "\n" not in str(refused.value)


def test_the_server_checks_the_segment_ids_it_receives(tmp_path, chat_model):
    experiment = train(0, **config(tmp_path, chat_model, packing=True, batch_size=4))
    checks, forward = Checks(experiment.blueprint), ClientNode.forward.__verb__
    client = experiment.roles.clients[0]
    client.batch_segments = client.segments[:2]  # the client's smashed data of two sequences, as a step sends it
    smashed = client.client_output(client.x[:2]).detach()
    sent = {"smashed": smashed, "labels": client.y[:2], "segments": client.segments[:2]}
    checks.result("forward", forward, (0,), sent)
    for segments, message in (
        (None, "returns exactly ['labels', 'segments', 'smashed']"),
        (client.segments[:2].int(), "segments are torch.int32 (2, 64), expected torch.int64 (2, 64)"),
        (client.segments[:1], "segments are torch.int64 (1, 64), expected torch.int64 (2, 64)"),
        (client.segments[:2].flip(1), "segments are not nondecreasing from 0"),
    ):
        result = {key: value for key, value in {**sent, "segments": segments}.items() if value is not None}
        with pytest.raises(Refused, match=re.escape(message)) as refusal:
            checks.result("forward", forward, (0,), result)
        assert "\n" not in str(refusal.value)
