"""Accuracy vs GiB communicated: FedAvg, SplitFed v1/v2, CSE-FSL and FSL-SAGE (issue 3).

Fashion-MNIST, the CNN cut after conv1 (the smashed data, 32x14x14 floats = 25 kB a sample, is
larger than the image), 10 clients, label-Dirichlet alpha in {0.1, 1000}, Adam 1e-3 for every
algorithm, q = 5, aux = stage (conv2 + pooling + fc). The scale is cut to what runs in minutes
on a 2-core CPU (`--train-subset` samples, `--rounds` rounds); the FSL-SAGE paper's is ResNet-18
on CIFAR-10 up to 200 GiB. Runs go through the sweep machinery (re-running resumes and skips
finished runs); the report (results.csv, report.md, plots/accuracy_vs_gib.png) lands in `--out`,
and this script prints the GiB each algorithm needed to first reach each `--target` accuracy.

    nice .venv/bin/python benchmarks/fsl_comm.py [--rounds 10] [--train-subset 2000] [--jobs 2]
"""

from __future__ import annotations

import argparse

from splitlab.experiments.report import collect_results, write_report
from splitlab.experiments.sweep import run_sweep

ALGORITHMS = ["fedavg", "sfl_v1", "sfl_v2", "cse_fsl", "fsl_sage"]


def sweep(args: argparse.Namespace) -> dict:
    return {
        "description": "issue 3: accuracy vs GiB of the auxiliary-model algorithms and their baselines",
        "base": dict(
            dataset="fashion_mnist",
            model="cnn",
            cut=1,
            clients=10,
            rounds=args.rounds,
            train_subset=args.train_subset,
            test_subset=args.test_subset,
            batch_size=args.batch_size,
            optimizer="adam",
            lr=1e-3,
            seed=0,
            device="cpu",
            ledger=args.ledger,
        ),
        "axes": {"partition": [f"dirichlet:{alpha:g}" for alpha in args.alphas], "algorithm": ALGORITHMS},
        "overrides": [
            {"when": {"algorithm": ["cse_fsl", "fsl_sage"]}, "set": {"server_update_interval": 5, "aux": "stage"}},
            {"when": {"algorithm": "fsl_sage"}, "set": {"align_interval": args.align_interval}},
        ],
        "report": {"target_accuracy": args.target[0]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--train-subset", type=int, default=2000)
    parser.add_argument("--test-subset", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--align-interval", type=int, default=5, help="l of FSL-SAGE (authors: 10)")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 1000])
    parser.add_argument(
        "--target",
        type=float,
        nargs="+",
        default=[0.6, 0.7],
        help="test accuracies (fractions) for the GiB tables; the first goes into report.md",
    )
    parser.add_argument("--ledger", choices=["splitlab", "fsl_sage"], default="splitlab")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="runs/fsl_comm")
    args = parser.parse_args()

    run_sweep(sweep(args), out=args.out, jobs=args.jobs)
    print(f"report: {write_report(args.out, args.target[0])}")
    to_target = [
        {row["run"]: row.get("gib_to_target") for row in collect_results(args.out, target)} for target in args.target
    ]
    print(
        "\n| partition | algorithm | best acc | final acc | GiB total | "
        + " | ".join(f"GiB to {100 * t:g}%" for t in args.target)
        + " |"
    )
    print("|---|---|---|---|---|" + "---|" * len(args.target))
    for row in collect_results(args.out):
        print(
            f"| {row['partition']} | {row['algorithm']} | {_pct(row.get('best_accuracy'))} | "
            f"{_pct(row.get('final_accuracy'))} | {_num(row.get('total_gib'))} | "
            + " | ".join(_num(gib[row["run"]]) for gib in to_target)
            + " |"
        )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _num(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    main()
