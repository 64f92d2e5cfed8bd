"""LoRA: a fresh adapter changes nothing, only adapters train, merging is exact, bad targets are named."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from splitlab.errors import UserError
from splitlab.models.lora import DEFAULT_TARGETS, LoraLinear, apply_lora, merge_lora


def tiny_gpt2(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)
    return GPT2LMHeadModel(config).eval()


def plain_block(seed: int = 0) -> nn.Module:
    """`nn.Linear` layers under GPT-2's names, as `model=gpt` has them."""
    torch.manual_seed(seed)
    attn = nn.Sequential(OrderedDict(c_attn=nn.Linear(8, 24), act=nn.Tanh(), c_proj=nn.Linear(24, 8)))
    mlp = nn.Sequential(OrderedDict(c_fc=nn.Linear(8, 16), act=nn.Tanh(), c_proj=nn.Linear(16, 8, bias=False)))
    return nn.Sequential(OrderedDict(attn=attn, mlp=mlp))


def test_a_fresh_adapter_leaves_the_output_bit_identical():
    tokens = torch.randint(0, 50, (2, 8))
    for targets in (None, ["c_attn", "c_proj", "c_fc"]):
        model = tiny_gpt2()
        with torch.no_grad():
            expected = model(tokens).logits
            apply_lora(model, rank=4, alpha=8, targets=targets)
            torch.testing.assert_close(model(tokens).logits, expected, rtol=0, atol=0)
    block, x = plain_block(), torch.randn(3, 5, 8)
    with torch.no_grad():
        expected = block(x)
        apply_lora(block, rank=2, alpha=4, targets=["c_attn", "c_proj"])
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)


def test_only_the_adapters_train_and_their_bytes_are_rank_times_in_plus_out():
    model = tiny_gpt2()
    names = set(model.state_dict())
    wrapped = apply_lora(model, rank=4, alpha=8)
    assert wrapped == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]  # GPT-2's default
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert set(trainable) == {f"{w}.{ab}" for w in wrapped for ab in ("lora_A", "lora_B")}
    # c_attn: 32 in, 96 out; A is 4 x 32 and B 96 x 4, float32: (128 + 384) * 4 bytes, two layers
    assert sum(p.numel() * p.element_size() for p in trainable.values()) == 2 * (4 * 32 + 96 * 4) * 4
    assert set(model.state_dict()) == names | set(trainable), "the base keeps its parameter names"


def test_targets_match_whole_name_components():
    assert "c_attn" in DEFAULT_TARGETS
    block = plain_block()
    assert apply_lora(block, 1, 1.0, ["c_proj"]) == ["attn.c_proj", "mlp.c_proj"]
    assert apply_lora(plain_block(), 1, 1.0, ["attn.c_proj"]) == ["attn.c_proj"]
    with pytest.raises(UserError, match="'proj' names no linear layer"):
        apply_lora(plain_block(), 1, 1.0, ["proj"])  # a suffix of a name is not a name


def test_a_target_that_is_no_linear_layer_is_refused_in_one_line_naming_the_choices():
    with pytest.raises(UserError, match=r"'q_proj' names no linear layer.*available: c_attn, c_proj, c_fc$"):
        apply_lora(plain_block(), 4, 8.0, ["c_attn", "q_proj"])
    with pytest.raises(UserError, match="'act' names no linear layer"):
        apply_lora(plain_block(), 4, 8.0, ["act"])
    no_defaults = nn.Sequential(OrderedDict(fc=nn.Linear(2, 2)))
    with pytest.raises(UserError, match="none of the default LoRA targets.*from: fc"):
        apply_lora(no_defaults, 4, 8.0)
    with pytest.raises(UserError, match="rank must be at least 1"):
        apply_lora(plain_block(), 0, 8.0)


def test_the_adapters_are_drawn_from_the_global_generator():
    a, b, c = plain_block(), plain_block(), plain_block()
    for model, seed in ((a, 5), (b, 5), (c, 6)):
        torch.manual_seed(seed)
        apply_lora(model, 2, 4.0, ["c_attn"])
    assert torch.equal(a.attn.c_attn.lora_A, b.attn.c_attn.lora_A)
    assert not torch.equal(a.attn.c_attn.lora_A, c.attn.c_attn.lora_A)
    assert torch.count_nonzero(a.attn.c_attn.lora_B) == 0


def train_one_step(model: nn.Module, loss_of) -> None:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    loss_of(model).backward()
    optimizer.step()


def test_merged_weights_give_the_trained_lora_models_output_in_a_plain_model():
    tokens = torch.randint(0, 50, (2, 8))
    model = tiny_gpt2()
    base = {name: t.clone() for name, t in model.state_dict().items()}
    apply_lora(model, rank=4, alpha=16, targets=["c_attn", "mlp.c_proj"])  # Conv1D layers
    train_one_step(model, lambda m: m(tokens).logits.square().mean())
    assert all(torch.equal(t, base[name]) for name, t in model.state_dict().items() if name in base), "base frozen"
    merged = merge_lora(model)
    assert set(merged) == set(base)
    assert not torch.equal(merged["transformer.h.0.attn.c_attn.weight"], base["transformer.h.0.attn.c_attn.weight"])
    plain = tiny_gpt2(seed=1)
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, model(tokens).logits, rtol=1e-5, atol=1e-6)

    block, x = plain_block(), torch.randn(3, 5, 8)
    apply_lora(block, rank=2, alpha=4, targets=["c_attn", "c_proj"])  # nn.Linear, one without bias
    train_one_step(block, lambda m: m(x).square().mean())
    plain_linear = plain_block(seed=1)
    plain_linear.load_state_dict(merge_lora(block))
    with torch.no_grad():
        torch.testing.assert_close(plain_linear(x), block(x), rtol=1e-5, atol=1e-6)


def test_the_wrapped_layer_keeps_the_base_tensors_themselves():
    block = plain_block()
    weight = block.attn.c_attn.weight
    apply_lora(block, 2, 4.0, ["c_attn"])
    assert isinstance(block.attn.c_attn, LoraLinear)
    assert block.attn.c_attn.weight is weight and not weight.requires_grad


def test_lora_dropout_drops_the_adapters_input_as_peft_from_a_keyed_stream():
    """peft's `lora_B(lora_A(dropout(x))) * scaling` beside the frozen path on the whole input; the
    mask drawn from the layer's key and the input, never from torch's global random state."""
    torch.manual_seed(0)
    layer = LoraLinear(nn.Linear(64, 8), rank=4, alpha=8, dropout=0.25, key="0:fc")
    nn.init.normal_(layer.lora_B)
    x = torch.randn(32, 64)
    global_state = torch.get_rng_state()
    dropped = layer.lora_dropout(x)
    assert torch.equal(torch.get_rng_state(), global_state)
    kept = dropped != 0
    assert 0.2 < 1 - float(kept.float().mean()) < 0.3
    assert torch.allclose(dropped[kept], x[kept] / 0.75)
    assert torch.equal(layer.lora_dropout(x), dropped)  # the same input and key, the same mask
    other = LoraLinear(nn.Linear(64, 8), rank=4, alpha=8, dropout=0.25, key="0:other")
    assert not torch.equal(other.lora_dropout(x), dropped)
    with torch.no_grad():
        frozen = nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.allclose(layer(x), frozen + dropped @ layer.lora_A.T @ layer.lora_B.T * 2, atol=1e-6)
        layer.eval()  # no dropout in evaluation
        assert torch.allclose(layer(x), frozen + x @ layer.lora_A.T @ layer.lora_B.T * 2, atol=1e-6)


def test_a_split_that_leaves_the_client_nothing_to_train_names_the_cuts_that_would():
    """The CNN's linear layers (`1` in fc1, `out`) are all on the server at cut 1, so LoRA on them
    would leave the client part's optimizer empty: refused, naming cut 3 (fc1 on the client)."""
    from splitlab.algorithms import get_algorithm
    from splitlab.config import RunConfig
    from splitlab.models import build_model
    from splitlab.settings.horizontal import check_split

    model = build_model("cnn", (1, 28, 28), 10, lora=(4, 8.0), lora_targets=("out", "1"))
    with pytest.raises(UserError) as refused:
        check_split(model, RunConfig(algorithm="sfl_v2", model="cnn", cut=1), get_algorithm("sfl_v2"))
    assert str(refused.value) == (
        "cut=1 leaves the client part nothing to train (lora trains only its adapters, none in that part); "
        "cuts that train both parts: 3"
    )
    check_split(model, RunConfig(algorithm="sfl_v2", model="cnn", cut=3), get_algorithm("sfl_v2"))


def test_all_linear_adapts_every_linear_layer_but_the_output_layer():
    from splitlab.models import build_model

    model = build_model(
        "gpt", (8,), 20, lora=(2, 4.0), lora_targets=("all-linear",), layers=2, heads=2, width=8, context=8
    )
    adapted = sorted({name.rsplit(".", 2)[-2] for name, p in model.named_parameters() if p.requires_grad})
    assert adapted == ["c_attn", "c_fc", "c_proj"]  # attention's and the MLP's; not head.lm_head
    assert sum(name.endswith("lora_A") for name, _ in model.named_parameters()) == 2 * 4
