"""Packing (issue 43): chat rows several to a sequence (data/text_rows.py `pack`), attention and
positions kept within each row (models/packed.py), give each row the loss it has alone, also
split into a client part and a server part that each see the batch's rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_helpers import tiny_hf_model, tiny_tokenizer
from splitlab.data.language import targets_of
from splitlab.data.text_rows import Rows, encode, pack
from splitlab.models import packed, split
from splitlab.models.gpt import gpt
from splitlab.models.hf import load_staged
from splitlab.targets import IGNORED

SEQ_LEN = 64
#: renders a conversation as `r:content<eos>` (r: the role's initial), to keep rows short
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}{{ eos_token }}{% endfor %}"


def chat_rows():
    """(inputs, targets) of ten conversations of different lengths, padded to SEQ_LEN, with a chat template."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    conversations = [
        [
            {"role": "system" if i % 2 else "user", "content": "Be"},
            {"role": "user", "content": "To be" * (1 + i % 3)},
            {"role": "assistant", "content": "or" + "!" * i},
        ]
        for i in range(10)
    ]
    rows = Rows("messages", conversations, [f"row {i}" for i in range(10)])
    tokens, mask = encode(rows, tokenizer, SEQ_LEN, "test")
    return (*targets_of(tokens, mask), len(tokenizer))


def row_losses(token_losses: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Each row's mean loss over its targets in the loss."""
    return [float(loss[t != IGNORED].mean()) for loss, t in zip(token_losses, y)]


def token_losses(model, x: torch.Tensor, y: torch.Tensor, segments: torch.Tensor | None = None) -> torch.Tensor:
    with packed.rows(segments):
        logits = model(x)
    return F.cross_entropy(logits.transpose(1, 2), y, ignore_index=IGNORED, reduction="none")


def test_pack_puts_rows_first_fit_in_data_order_up_to_their_last_target_in_the_loss():
    x = torch.arange(24).view(4, 6)
    y = torch.full((4, 6), IGNORED)
    y[0, 3], y[1, 1], y[2, 0], y[3, 4] = 1, 2, 3, 4  # rows of 4, 2, 1 and 5 positions
    inputs, targets, segments = pack(x, y, pad=-1)
    assert inputs.tolist() == [[0, 1, 2, 3, 6, 7], [12, 18, 19, 20, 21, 22]]
    assert segments.tolist() == [[0, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1]]
    assert targets[targets != IGNORED].tolist() == [1, 2, 3, 4]
    x, y = x[:1], y[:1]  # a row alone: its padding has a segment of its own
    assert pack(x, y, pad=-1)[0].tolist() == [[0, 1, 2, 3, -1, -1]]
    assert pack(x, y, pad=-1)[2].tolist() == [[0, 0, 0, 0, 1, 1]]


def test_positions_restart_at_each_row():
    with packed.rows(torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 1, 1, 1, 1]])):
        assert packed.positions(6, torch.device("cpu")).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    assert packed.positions(3, torch.device("cpu")).tolist() == [[0, 1, 2]]


def assert_packed_rows_lose_as_alone(model, cut: int) -> None:
    """Each row's loss in packed sequences (whole model, and client part then server part with the
    segment ids on both sides) equals its loss run alone unpacked, to 1e-5; so does the batch's."""
    x, y, _ = chat_rows()
    inputs, targets, segments = pack(x, y, pad=0)
    assert len(inputs) < len(x)  # several rows per sequence
    model.eval()
    with torch.no_grad():
        alone = row_losses(token_losses(model, x, y), y)
        alone_by_row = {tuple(x[i][y[i] != IGNORED].tolist()): loss for i, loss in enumerate(alone)}
        alone_batch = float(token_losses(model, x, y)[y != IGNORED].mean())
        whole = token_losses(model, inputs, targets, segments)
        client, server = split(model, cut)
        with packed.rows(segments):
            smashed = client(inputs)
        parted = token_losses(server, smashed, targets, segments)
    for losses in (whole, parted):
        packed_rows = {  # keyed by the row's inputs at its targets in the loss (distinct in these rows)
            tuple(row[(segment == s) & (t != IGNORED)].tolist()): float(loss[(segment == s) & (t != IGNORED)].mean())
            for row, loss, t, segment in zip(inputs, losses, targets, segments)
            for s in range(int(segment.max()))
        }
        assert len(alone_by_row) == len(x) and packed_rows.keys() == alone_by_row.keys()
        assert [packed_rows[row] for row in alone_by_row] == pytest.approx(list(alone_by_row.values()), abs=1e-5)
        batch = float(losses[targets != IGNORED].mean())
        assert batch == pytest.approx(alone_batch, abs=1e-5)


def test_model_gpt_packed_rows_lose_as_alone():
    torch.manual_seed(0)
    assert_packed_rows_lose_as_alone(gpt((SEQ_LEN,), chat_rows()[2], layers=2, heads=2, width=16, context=SEQ_LEN), 1)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # learned positions; rotary ones
def test_model_hf_packed_rows_lose_as_alone(tmp_path, arch):
    assert_packed_rows_lose_as_alone(load_staged(tiny_hf_model(tmp_path, arch, layers=2)), 1)


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_split_step_on_packed_rows_has_the_gradients_of_the_rows_unpacked(checkpointed):
    """One split step as sfl_v2 takes it (client part forward, smashed data up with the batch's
    segment ids beside the labels, server part's loss and backward, the cut gradient down, the
    client's backward): every parameter's gradient equals that of the unpacked rows' batch loss,
    also where stages are recomputed in the backward pass (gradient_checkpointing), outside `rows`."""
    x, y, vocab = chat_rows()
    torch.manual_seed(0)
    model = gpt((SEQ_LEN,), vocab, layers=2, heads=2, width=16, context=SEQ_LEN)
    token_losses(model, x, y)[y != IGNORED].mean().backward()
    model.checkpointed = checkpointed
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    inputs, targets, segments = pack(x, y, pad=0)
    client, server = split(model, 1)
    with packed.rows(segments):
        smashed = client(inputs)
    received = smashed.detach().requires_grad_()
    token_losses(server, received, targets, segments)[targets != IGNORED].mean().backward()
    smashed.backward(received.grad)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=1e-5, msg=name)
