"""model=hf: checkpoints on disk as stages that compose to transformers' logits at every cut, the
refusals, and the export that `from_pretrained` loads back to the same logits."""

from __future__ import annotations

import json
from copy import deepcopy

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

from hf_helpers import tiny_hf_model, tiny_tokenizer
from splitlab.errors import UserError
from splitlab.models import split
from splitlab.models.hf import (
    GPT2_CONV1D,
    LAYOUTS,
    char_tokenizer,
    context_length,
    gpt2_config,
    hf_model,
    load_staged,
    load_tokenizer,
    read_config,
    save_gpt2,
    save_hf,
    staged_from_hf,
    to_hf_names,
)
from splitlab.models.lora import apply_lora, merge_lora

ARCHS = ["gpt2", "llama", "qwen2", "mistral"]  # mistral's sliding window (4) is shorter than the sequences


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    return request.param, tiny_hf_model(tmp_path_factory.mktemp(request.param), request.param)


def logits_of(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return getattr(out, "logits", out)


def test_stages_compose_to_the_transformers_logits_at_every_cut(checkpoint):
    arch, folder = checkpoint
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()  # transformers' default attention
    staged = load_staged(folder).eval()
    assert list(dict(staged.named_children())) == ["embed", "block1", "block2", "block3", "head"]
    assert staged.valid_cuts == [1, 2, 3] and staged.client_stage_count(1) == 2
    tokens = torch.randint(0, reference.config.vocab_size, (2, 10))
    expected = logits_of(reference, tokens)
    for cut in staged.valid_cuts:
        client, server = split(staged, cut)
        hidden = logits_of(client, tokens)
        assert hidden.shape == (2, 10, 32)
        torch.testing.assert_close(logits_of(server, hidden), expected, rtol=0, atol=1e-5)
    names = to_hf_names(staged.state_dict(), LAYOUTS[arch])
    assert set(names) == set(reference.state_dict()), "every stage tensor has its transformers name"


def test_a_tied_lm_head_gets_its_own_copy_of_the_embedding(checkpoint):
    arch, folder = checkpoint
    staged = load_staged(folder)
    embedding = staged.embed.wte.weight if arch == "gpt2" else staged.embed.embed_tokens.weight
    assert staged.head.lm_head.weight is not embedding
    assert torch.equal(staged.head.lm_head.weight, embedding)
    client, server = split(staged, 1)
    assert not {p.data_ptr() for p in client.parameters()} & {p.data_ptr() for p in server.parameters()}


def test_config_and_context_length(checkpoint):
    arch, folder = checkpoint
    config = read_config(folder)
    assert config["model_type"] == arch and context_length(config) == 64


def test_folders_splitlab_cannot_load_are_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="the folder does not exist"):
        read_config(tmp_path / "absent")
    with pytest.raises(UserError, match="no config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(UserError, match=r"only pickled weights \(pytorch_model.bin\).*never loads"):
        load_staged(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    with pytest.raises(UserError, match="no model.safetensors or model.safetensors.index.json"):
        read_config(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(
        UserError, match="architecture 'bert' is not supported; supported: gpt2, llama, qwen2, mistral$"
    ):
        load_staged(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="config.json: not valid JSON"):
        read_config(tmp_path)
    with pytest.raises(UserError, match="no usable tokenizer"):
        load_tokenizer(tmp_path)


def test_sharded_weights_load(tmp_path):
    source = tiny_hf_model(tmp_path / "one", "llama")
    model = AutoModelForCausalLM.from_pretrained(source)
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    tokens = torch.randint(0, model.config.vocab_size, (1, 6))
    torch.testing.assert_close(
        logits_of(load_staged(tmp_path / "sharded").eval(), tokens), logits_of(model.eval(), tokens), atol=1e-5, rtol=0
    )


def train_one_step(model, tokens):
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1.0)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()


def test_export_with_lora_merged_loads_back_to_the_same_logits_and_keeps_the_tie(checkpoint, tmp_path):
    arch, folder = checkpoint
    staged = load_staged(folder)
    tokens = torch.randint(0, 300, (2, 8))
    torch.manual_seed(0)
    apply_lora(staged, rank=4, alpha=8)
    train_one_step(staged.eval(), tokens)  # eval: GPT-2's dropout off, so the logits compare
    save_hf(merge_lora(staged), folder, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    torch.testing.assert_close(logits_of(reloaded, tokens), logits_of(staged, tokens), rtol=0, atol=1e-5)
    assert reloaded.config.tie_word_embeddings, "the embedding stayed frozen, so the tie holds"
    text = "The Eagle is a coffee shop."
    assert (
        AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"] == load_tokenizer(folder)(text)["input_ids"]
    )
    assert not list(tmp_path.glob(".*.tmp")), "no temporary folder left"
    assert (tmp_path / "hf" / "generation_config.json").read_text() == (folder / "generation_config.json").read_text()


def test_export_unties_a_trained_embedding_from_the_head(tmp_path):
    folder = tiny_hf_model(tmp_path / "gpt2", "gpt2")
    staged = load_staged(folder).eval()
    tokens = torch.randint(0, 300, (2, 8))
    train_one_step(staged, tokens)  # everything trains: the embedding and the head's copy drift apart
    save_hf(staged.state_dict(), folder, tmp_path / "hf")
    save_hf(staged.state_dict(), folder, tmp_path / "hf")  # over an earlier export
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not reloaded.config.tie_word_embeddings
    torch.testing.assert_close(logits_of(reloaded, tokens), logits_of(staged, tokens), rtol=0, atol=1e-5)


def as_model_gpt(state):
    """A GPT-2 staged state under `model=gpt`'s names: no `.layer` level, `nn.Linear` weights."""
    out = {}
    for name, tensor in state.items():
        stage, _, rest = name.partition(".")
        rest = rest.removeprefix("layer.")
        out[f"{stage}.{rest}"] = tensor.T if rest in GPT2_CONV1D else tensor
    return out


def test_save_gpt2_maps_model_gpts_names_and_layout_onto_gpt2(tmp_path):
    vocab = "\n abcdefghij"
    config = gpt2_config(layers=2, heads=2, width=16, context=12, vocab=len(vocab))
    torch.manual_seed(0)
    original = GPT2LMHeadModel(config).eval()
    staged = staged_from_hf(original)
    state = as_model_gpt(staged.state_dict())
    assert "block1.attn.c_attn.weight" in state and state["block1.attn.c_attn.weight"].shape == (48, 16)
    save_gpt2(state, config, tmp_path / "hf", char_tokenizer(vocab, 12))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, len(vocab), (2, 12))
    torch.testing.assert_close(logits_of(reloaded, tokens), logits_of(original, tokens), rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer("a bad\nhead")["input_ids"] == [vocab.index(c) for c in "a bad\nhead"]
    assert tokenizer.decode([vocab.index(c) for c in "fig\n hij"]) == "fig\n hij"
    with pytest.raises(ValueError, match="no bias"):
        save_gpt2({**state, "head.lm_head.bias": torch.zeros(len(vocab))}, config, tmp_path / "other")


def test_the_tokenizer_loads_from_tokenizer_json(checkpoint):
    _, folder = checkpoint
    assert load_tokenizer(folder)("To be")["input_ids"] == tiny_tokenizer()("To be")["input_ids"]


def test_a_cut_gradient_can_be_differentiated_and_copies_are_independent(checkpoint):
    """FSL-SAGE's alignment takes a second derivative through the server's blocks; SFL-V1 and the
    auxiliary models deep-copy stages."""
    _, folder = checkpoint
    staged = load_staged(folder)
    client, server = split(staged, 1)
    hidden = client(torch.randint(0, 300, (2, 6))).detach().requires_grad_()
    (cut_gradient,) = torch.autograd.grad(server(hidden).square().mean(), hidden, create_graph=True)
    cut_gradient.square().sum().backward()
    assert staged.head.lm_head.weight.grad is not None
    before = logits_of(server, hidden)
    copy = deepcopy(server)
    with torch.no_grad():
        next(copy.block2.parameters()).add_(1.0)
    torch.testing.assert_close(logits_of(server, hidden), before, rtol=0, atol=0)
    assert not torch.equal(logits_of(copy, hidden), before)


def test_weights_that_lack_a_tensor_are_refused(tmp_path):
    folder = tiny_hf_model(tmp_path, "gpt2")
    weights = load_file(folder / "model.safetensors")
    del weights["transformer.h.1.ln_1.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"the weights lack 1 tensors of the model: \['transformer.h.1.ln_1.weight'\]"):
        load_staged(folder)


def test_the_model_zoo_builder_checks_the_data_against_the_model(tmp_path):
    folder = tiny_hf_model(tmp_path, "llama", layers=2)
    model = hf_model((64,), 300, model_dir=str(folder))
    assert model.valid_cuts == [1, 2]
    with pytest.raises(UserError, match="model=hf needs model_dir=DIR"):
        hf_model((16,), 300, model_dir=None)
    with pytest.raises(UserError, match="seq_len=65 is beyond the model's context of 64 tokens"):
        hf_model((65,), 300, model_dir=str(folder))
    with pytest.raises(UserError, match="tokens go up to 300, beyond the model's vocabulary of 300"):
        hf_model((16,), 301, model_dir=str(folder))
    with pytest.raises(UserError, match="takes token sequences"):
        hf_model((1, 28, 28), 10, model_dir=str(folder))


def test_an_untied_head_stays_its_own_tensor_through_the_export(tmp_path):
    folder = tiny_hf_model(tmp_path / "llama", "llama", tie=False)
    staged = load_staged(folder).eval()
    assert not torch.equal(staged.head.lm_head.weight, staged.embed.embed_tokens.weight)
    save_hf(staged.state_dict(), folder, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert not reloaded.config.tie_word_embeddings
    tokens = torch.randint(0, 300, (2, 8))
    torch.testing.assert_close(logits_of(reloaded, tokens), logits_of(staged, tokens), rtol=0, atol=1e-5)
