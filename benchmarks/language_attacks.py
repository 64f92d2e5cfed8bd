"""The token attacks on a split language model at cuts 1, 2 and 4, with and without d_chi-privacy
(issue 35): recovery against the shared floor, and the loss it costs.

Two models, 4 blocks of width 128 each: `model=gpt` (the CPU GPT, LEAF's characters as tokens,
trained from its seeded initialisation) and a tiny random Llama-layout checkpoint (`model=hf`:
4 layers, 4 heads and 2 key-value heads, a byte-level BPE of 512 tokens trained on the plays),
saved in a temporary folder as `save_pretrained` writes it. Per model, cut and defense: a
SplitFed-v2 run (`dataset=shakespeare_lm`, 64 tokens per sequence, 4 IID clients, 2 rounds, 400
training and 300 test sequences, seed 0: the language advisor's probe), then `token_inversion`,
`embedding_inversion` and `bisr` on 100 held-out sequences through the final model (auxiliary
text 200 sequences, decoder 20 epochs, `bisr` `--steps` optimisation steps); `--gradient-matching`
adds `gradient_matching` (8 sequences, 100 steps); `--lora R:ALPHA` fine-tunes the Llama's
adapters only (`lora=`: BiSR's setting, the client part's base weights the pretrained ones). One
torch thread; prints a Markdown table.

    .venv/bin/python benchmarks/language_attacks.py [--models gpt,llama] [--cuts 1,2,4]
        [--defenses none,dchi:1000,dchi:100] [--steps 100] [--gradient-matching] [--lora R:ALPHA]
        [--data-dir data]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from gpt2_split_vs_centralized import plays, save_random
from splitlab.audit.run import attack_run
from splitlab.engine import run

PROBE = dict(
    dataset="shakespeare_lm",
    algorithm="sfl_v2",
    clients=4,
    rounds=2,
    train_subset=400,
    test_subset=300,
    seq_len=64,
    seed=0,
)
ATTACK = dict(aux=200, targets=100, epochs=20)


def save_llama(folder: Path) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    save_random(folder, plays(), config, 512)
    return folder


def measure(config: dict, out: Path, steps: int, gradient_matching: bool) -> dict:
    summary = run({**config, "out": str(out)}, progress=False)
    token = attack_run(out, {"attack": "token_inversion", **ATTACK})
    embedding = attack_run(out, {"attack": "embedding_inversion", **ATTACK})
    bisr = attack_run(out, {"attack": "bisr", **ATTACK, "steps": steps})
    row = {
        "cut": config["cut"],
        "defense": config.get("defense", "none"),
        "loss": summary["final_loss"],
        "floor": token["baseline"],
        "token_inversion": token["decoder"],
        "embedding_nearest": embedding["nearest"],
        "embedding_mapped": embedding["mapped"],
        "bisr_learned": bisr["learned"],
        "bisr_optimised": bisr["optimised"],
        "bisr_example": (bisr.get("examples") or [{}])[0],
    }
    if gradient_matching:
        row["gradient_matching"] = attack_run(out, {"attack": "gradient_matching", **ATTACK, "steps": 100})["matched"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--cuts", default="1,2,4")
    parser.add_argument("--defenses", default="none,dchi:1000,dchi:100")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--gradient-matching", action="store_true")
    parser.add_argument("--lora", default=None, help="R:ALPHA, the Llama's adapters only")
    parser.add_argument("--data-dir", default="data")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        models = {"gpt": {"model": "gpt"}}
        if "llama" in args.models.split(","):
            llama = {"model": "hf", "model_dir": str(save_llama(Path(scratch) / "llama"))}
            models["llama"] = {**llama, **({"lora": args.lora} if args.lora else {})}
        for name in args.models.split(","):
            for cut in map(int, args.cuts.split(",")):
                for defense in args.defenses.split(","):
                    config = {**PROBE, **models[name], "data_dir": args.data_dir, "cut": cut, "defense": defense}
                    out = Path(scratch) / f"{name}_{cut}_{defense.replace(':', '')}"
                    row = {"model": name, **measure(config, out, args.steps, args.gradient_matching)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    gm = args.gradient_matching
    print(
        "| model | cut | defense | loss | floor | token_inversion | embedding_inversion nearest / mapped "
        f"| bisr (a) / (b) |{' gradient_matching |' if gm else ''}"
    )
    print(f"|---|---|---|---|---|---|---|---|{'---|' if gm else ''}")
    for r in rows:
        extra = f" {r['gradient_matching']:.1%} |" if gm else ""
        print(
            f"| {r['model']} | {r['cut']} | {r['defense']} | {r['loss']:.3f} | {r['floor']:.1%} "
            f"| {r['token_inversion']:.1%} | {r['embedding_nearest']:.1%} / {r['embedding_mapped']:.1%} "
            f"| {r['bisr_learned']:.1%} / {r['bisr_optimised']:.1%} |{extra}"
        )


if __name__ == "__main__":
    main()
