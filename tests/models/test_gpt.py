"""model=gpt: staged by block, every cut composing to the unsplit model, its settings checked."""

from __future__ import annotations

import pytest
import torch

from splitlab.errors import UserError
from splitlab.models import build_model, split

SIZES = dict(layers=3, heads=2, width=16, context=24)


def test_split_at_every_cut_gives_the_unsplit_logits():
    model = build_model("gpt", (20,), 11, seed=3, **SIZES).eval()
    tokens = torch.randint(0, 11, (4, 20), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape == (4, 20, 11)
    assert model.valid_cuts == [1, 2, 3]
    for cut in model.valid_cuts:
        client, server = split(model, cut)
        assert [name for name, _ in client.named_children()] == ["embed", *(f"block{i}" for i in range(1, cut + 1))]
        hidden = client(tokens)
        assert hidden.shape == (4, 20, 16)
        assert torch.equal(server(hidden), logits)


def test_attention_is_causal():
    model = build_model("gpt", (10,), 7, **SIZES).eval()
    tokens = torch.randint(0, 7, (1, 10), generator=torch.Generator().manual_seed(1))
    changed = tokens.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 7
    assert torch.equal(model(tokens)[0, :6], model(changed)[0, :6])
    assert not torch.equal(model(tokens)[0, 6:], model(changed)[0, 6:])


def test_sizes_and_seed_set_the_model():
    model = build_model("gpt", (8,), 5, seed=0, **SIZES)
    assert len(list(model.named_children())) == 5  # embed, 3 blocks, head
    again = build_model("gpt", (8,), 5, seed=0, **SIZES)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize(
    "shape,options,message",
    [
        ((40,), SIZES, "seq_len=40 is beyond the model's context of 24 tokens"),
        ((8,), {**SIZES, "heads": 3}, "width=16 must be a multiple of heads=3"),
        ((1, 8, 8), SIZES, "model=gpt takes token sequences"),
    ],
)
def test_bad_settings_are_one_line(shape, options, message):
    with pytest.raises(UserError, match=message):
        build_model("gpt", shape, 5, **options)


def test_a_size_key_for_a_model_without_it_is_refused():
    with pytest.raises(UserError, match="layers= does not apply to model=mlp"):
        build_model("mlp", (1, 8, 8), 10, layers=2)
