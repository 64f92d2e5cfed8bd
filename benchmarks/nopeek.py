"""NoPeek against the current attacks: does distance correlation, and what the attacks recover,
fall with `nopeek:A`, and at which cuts?

For every cut and NoPeek weight: a SplitFed-v2 run with `record=` of the last round; then, on
what the server recorded, the distance correlation between the inputs and the smashed data (the
quantity NoPeek penalises; splitlab.privacy.defenses.distance_correlation), input reconstruction
(SSIM of the stronger of the decoder and the mean-image floor, and of the decoder alone), label
inference from cut gradients (direction AUC), and model completion (label accuracy of the
client part completed with 10 labelled samples of each class). One torch thread; prints a
Markdown table (docs/privacy.md holds the measured one).

    .venv/bin/python benchmarks/nopeek.py [--dataset fashion_mnist] [--cuts 1 2] [--alphas 0 1]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from splitlab.audit.run import attack_run
from splitlab.engine import run
from splitlab.privacy.defenses import distance_correlation


def measure(config: dict, out: Path, epochs: int, labelled: int) -> dict:
    summary = run({**config, "out": str(out)}, progress=False)
    record = load_file(sorted((out / "record").iterdir())[-1])
    inversion = attack_run(out, {"attack": "inversion", "epochs": epochs})
    leak = attack_run(out, {"attack": "label_leak"})
    completion = attack_run(out, {"attack": "model_completion", "aux": labelled})
    return {
        "accuracy": summary["final_accuracy"],
        "dcor": float(
            distance_correlation(record["inputs"].flatten(1).double(), record["smashed"].flatten(1).double())
        ),
        "ssim": inversion["ssim"],
        "decoder_ssim": inversion["decoder"]["ssim"],
        "floor_ssim": inversion["baseline"]["ssim"],
        "direction_auc": leak["direction_auc"],
        "completion": completion["accuracy"],
        "completion_untrained": completion["untrained_accuracy"],
        "completion_floor": completion["floor"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--cuts", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--train-subset", type=int, default=2000)
    parser.add_argument("--test-subset", type=int, default=1000, help="the attacks' auxiliary pool")
    parser.add_argument("--epochs", type=int, default=10, help="decoder epochs")
    parser.add_argument("--labelled", type=int, default=100, help="model completion's labelled samples")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = dict(
        algorithm="sfl_v2",
        dataset=args.dataset,
        model=args.model,
        clients=4,
        rounds=args.rounds,
        train_subset=args.train_subset,
        test_subset=args.test_subset if args.dataset != "digits" else None,
        record=500,
        device="cpu",
        seed=0,
    )
    print(f"{args.dataset}, {args.model}, sfl_v2, 4 clients, {args.rounds} rounds, train_subset={args.train_subset}")
    print(
        "| cut | defense | accuracy | dCor(inputs, smashed) | SSIM | decoder SSIM | direction AUC "
        "| completion accuracy | untrained client part |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for cut in args.cuts:
            for alpha in args.alphas:
                defense = f"nopeek:{alpha:g}" if alpha else "none"
                row = measure(
                    {**base, "cut": cut, "defense": defense}, Path(tmp) / f"{cut}_{alpha}", args.epochs, args.labelled
                )
                print(
                    f"| {cut} | {defense} | {row['accuracy']:.2%} | {row['dcor']:.3f} | {row['ssim']:.3f} "
                    f"| {row['decoder_ssim']:.3f} | {row['direction_auc']:.3f} | {row['completion']:.2%} "
                    f"| {row['completion_untrained']:.2%} |",
                    flush=True,
                )
    print(f"floors: SSIM {row['floor_ssim']:.3f} (mean image), label accuracy {row['completion_floor']:.2%} (majority)")


if __name__ == "__main__":
    main()
