"""Tiny random Hugging Face checkpoints on disk, in the format `save_pretrained` writes, for the
`model=hf` tests: safetensors weights, config.json and a byte-level BPE `tokenizer.json`."""

from __future__ import annotations

from pathlib import Path

import torch

EOS = "<|endoftext|>"
TEXT = [
    "name[The Eagle], eatType[coffee shop], food[French], priceRange[moderate]",
    "The Eagle is a moderately priced coffee shop serving French food.",
    "To be, or not to be, that is the question:",
    "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune,",
]


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE (GPT-2's scheme) trained on a few lines, with `EOS` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TEXT, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, bos_token=EOS)


def tiny_config(arch: str, vocab_size: int, layers: int = 3, tie: bool = True):
    """A 32-wide model of `arch` (gpt2, llama, qwen2, mistral: its sliding window is 4 tokens)."""
    import transformers

    common = {"vocab_size": vocab_size, "tie_word_embeddings": tie, "bos_token_id": 0, "eos_token_id": 0}
    if arch == "gpt2":
        return transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, n_positions=64, **common)
    llama_like = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        **common,
    }
    if arch == "mistral":
        return transformers.MistralConfig(sliding_window=4, **llama_like)
    return {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch](**llama_like)


def tiny_hf_model(
    folder: Path, arch: str = "gpt2", layers: int = 3, tie: bool = True, seed: int = 0, chat_template: str | None = None
) -> Path:
    """Save a random `arch` causal LM with its tokenizer (with `chat_template` if given) into
    `folder` (created) and return it."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = chat_template
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tokenizer), layers, tie))
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder
