"""What each cut and each defense leaks, costs and buys, measured side by side in one run.

For every configuration (cuts 1..3 without a defense, then each defense at cut 1): a SplitFed-v2
run with `record=` of the last round, then both attacks of a curious server on what it recorded
(splitlab.audit.run): input reconstruction (SSIM / PSNR of the stronger of the decoder and the
floor of the auxiliary mean image, and the decoder's own SSIM) and label inference from the cut
gradients (direction and norm AUC), with the run's accuracy (undefended path and as deployed), the
bytes of smashed data and cut gradients, and epsilon (PLD) where clip + noise apply.
One torch thread; prints a Markdown table (docs/privacy.md holds the measured one).

    .venv/bin/python benchmarks/privacy.py [--dataset fashion_mnist] [--rounds 3] [--train-subset 3000]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from splitlab.audit.run import attack_run
from splitlab.engine import run
from splitlab.units import format_bytes

DEFENSES = (
    "noise:0.5",
    "noise:2",
    "clip:10+noise:0.5",
    "clip:10+dp:epsilon=50",
    "nopeek:1",
    "quantize:int8",
    "topk:0.1",
    "gradnoise:1",
)


def measure(config: dict, out: Path, epochs: int) -> dict:
    summary = run({**config, "out": str(out)}, progress=False)
    inversion = attack_run(out, {"attack": "inversion", "epochs": epochs})
    leak = attack_run(out, {"attack": "label_leak"})
    privacy = summary.get("privacy", {})
    return {
        "cut": config["cut"],
        "defense": config["defense"],
        "accuracy": summary["final_accuracy"],
        "deployed": summary.get("final_accuracy_deployed"),
        "smashed": summary["comm_bytes_by_kind"]["smashed"],
        "cut_grad": summary["comm_bytes_by_kind"]["cut_grad"],
        "ssim": inversion["ssim"],
        "psnr": inversion["psnr"],
        "decoder_ssim": inversion["decoder"]["ssim"],
        "floor": inversion["baseline"],
        "direction_auc": leak["direction_auc"],
        "norm_auc": leak["norm_auc"],
        "epsilon": privacy.get("epsilon"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--train-subset", type=int, default=3000)
    parser.add_argument("--epochs", type=int, default=20, help="decoder epochs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    base = dict(
        algorithm="sfl_v2",
        dataset=args.dataset,
        model=args.model,
        clients=4,
        rounds=args.rounds,
        train_subset=args.train_subset,
        test_subset=2000 if args.dataset != "digits" else None,
        record=500,
        device="cpu",
        seed=0,
    )
    configs = [{**base, "cut": cut, "defense": "none"} for cut in (1, 2, 3)]
    configs += [{**base, "cut": 1, "defense": defense} for defense in DEFENSES]
    print(f"{args.dataset}, {args.model}, sfl_v2, 4 clients, {args.rounds} rounds, train_subset={args.train_subset}")
    print(
        "| cut | defense | accuracy | deployed | smashed | cut_grad | SSIM | decoder SSIM | PSNR (dB) "
        "| direction AUC | norm AUC | epsilon |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            row = measure(config, Path(tmp) / str(i), args.epochs)
            epsilon = f"{row['epsilon']:.3g}" if row["epsilon"] is not None else "-"
            deployed = f"{row['deployed']:.2%}" if row["deployed"] is not None else "="
            print(
                f"| {row['cut']} | {row['defense']} | {row['accuracy']:.2%} | {deployed} "
                f"| {format_bytes(row['smashed'])} | {format_bytes(row['cut_grad'])} "
                f"| {row['ssim']:.3f} | {row['decoder_ssim']:.3f} | {row['psnr']:.2f} "
                f"| {row['direction_auc']:.3f} | {row['norm_auc']:.3f} | {epsilon} |",
                flush=True,
            )
        print(f"floor (auxiliary mean image): SSIM {row['floor']['ssim']:.3f}, PSNR {row['floor']['psnr']:.2f} dB")


if __name__ == "__main__":
    main()
