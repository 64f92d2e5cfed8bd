"""CycleSL versions against their originals (issue 4's measurement), over seeds.

    nice .venv/bin/python benchmarks/cyclesl_compare.py [--rounds 200] [--seeds 0 1 2] [--out runs/cyclesl_compare]
    nice .venv/bin/python benchmarks/cyclesl_compare.py --dataset shakespeare ...
    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/cyclesl_compare.py --rounds 60 \
        --seeds $(seq 0 19) --algorithms sfl_v2 cycle_sfl --paired cycle_sfl sfl_v2 --threads 1

Fashion-MNIST (the 2x200 MLP cut after its first layer: the LEAF CNN is too slow on a 2-core
CPU): 100 clients, Dirichlet 0.1 over a 6000-sample pool, 5% participation, the sample-wise
90/10 per-client test split of the CycleSL paper. batch_size=256 exceeds every client's
training data (at most ~220 samples), so every method takes exactly one batch per sampled
client per round: the protocol of the CycleSL authors' code, for originals and cycle versions
alike. Prints mean ± std of the final and best test accuracy and of rounds-to-target; each run's
files are kept under --out (a finished run is not recomputed). With --paired A B it also compares
A and B seed by seed (a seed fixes the partition and the sampled clients for both): the paired
differences A - B (mean ± sample std, 95% t interval), a paired t-test, a Wilcoxon signed-rank
test, and how many seeds A won.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from scipy import stats

from splitlab.engine import run

ALGORITHMS = ["fedavg", "sfl_v1", "sfl_v2", "psl", "sglr", "cycle_sfl", "cycle_psl", "cycle_sglr"]
CYCLE_PARAMS = dict(server_epochs=1, server_batch_size=64)
SETTINGS = {
    "fashion_mnist": dict(
        dataset="fashion_mnist",
        model="mlp",
        cut=1,
        clients=100,
        partition="dirichlet:0.1",
        train_subset=6000,
        participation=0.05,
        test_split="client:0.1",
        batch_size=256,
        optimizer="adam",
        lr=1e-3,
        target_accuracy=0.6,
        eval_every=5,
    ),
    # LEAF's natural (play, role) clients; every role's held-out windows pooled as the test set.
    "shakespeare": dict(
        dataset="shakespeare",
        model="lstm",
        cut=1,
        clients="all",
        participation=0.05,
        batch_size=32,
        optimizer="adam",
        lr=3e-3,
        test_subset=2000,
        target_accuracy=0.35,
        eval_every=10,
    ),
}


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {std:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=sorted(SETTINGS), default="fashion_mnist")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS)
    parser.add_argument("--out", default="runs/cyclesl_compare")
    parser.add_argument("--paired", nargs=2, metavar=("A", "B"), help="seed-by-seed comparison of A - B")
    parser.add_argument("--threads", type=int, help="torch threads (1: leave the other cores to others)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    by_algorithm: dict[str, list[dict]] = {}

    print(
        f"| algorithm | final accuracy | best accuracy | rounds to {SETTINGS[args.dataset]['target_accuracy']:.0%} "
        f"(reached/seeds) | GiB | wall s |"
    )
    print("|---|---|---|---|---|---|")
    for algorithm in args.algorithms:
        summaries = []
        for seed in args.seeds:
            config = {
                **SETTINGS[args.dataset],
                "algorithm": algorithm,
                "rounds": args.rounds,
                "seed": seed,
                "device": "cpu",
                "resume": True,
                "out": str(Path(args.out) / args.dataset / f"{algorithm}_seed{seed}"),
            }
            if algorithm.startswith("cycle_"):
                config.update(CYCLE_PARAMS)
            summaries.append(run(config, progress=False))
        by_algorithm[algorithm] = summaries
        reached = [s["rounds_to_target"] for s in summaries if s["rounds_to_target"] is not None]
        print(
            f"| {algorithm} | {mean_std([s['final_accuracy'] for s in summaries])} "
            f"| {mean_std([s['best_accuracy'] for s in summaries])} "
            f"| {mean_std(reached)} ({len(reached)}/{len(summaries)}) "
            f"| {statistics.mean(s['total_gib'] for s in summaries):.3f} "
            f"| {statistics.mean(s['wall_seconds'] for s in summaries):.0f} |",
            flush=True,
        )
    if args.paired:
        paired(by_algorithm, *args.paired, args.seeds)


def paired(by_algorithm: dict[str, list[dict]], a: str, b: str, seeds: list[int]) -> None:
    """Seed-by-seed differences a - b of the final and best accuracy (points) and rounds to target."""
    print(f"\nPaired {a} - {b} over {len(seeds)} seeds (same seed = same partition and client sampling):")
    print(f"| metric | mean ± std of differences | 95% CI | paired t p | Wilcoxon p | {a} better |")
    print("|---|---|---|---|---|---|")
    for key, scale, higher in (
        ("final_accuracy", 100, True),
        ("best_accuracy", 100, True),
        ("rounds_to_target", 1, False),
    ):
        pairs = [
            (x[key], y[key])
            for x, y in zip(by_algorithm[a], by_algorithm[b])
            if x[key] is not None and y[key] is not None
        ]
        diffs = [scale * (x - y) for x, y in pairs]
        if len(diffs) < 2:
            continue
        mean, std = statistics.mean(diffs), statistics.stdev(diffs)
        half = stats.t.ppf(0.975, len(diffs) - 1) * std / len(diffs) ** 0.5
        t_p = stats.ttest_rel([scale * x for x, _ in pairs], [scale * y for _, y in pairs]).pvalue
        nonzero = [d for d in diffs if d != 0]
        w_p = stats.wilcoxon(nonzero).pvalue if nonzero else 1.0
        wins = sum(d > 0 if higher else d < 0 for d in diffs)
        print(
            f"| {key} | {mean:+.2f} ± {std:.2f} | [{mean - half:+.2f}, {mean + half:+.2f}] | {t_p:.3f} "
            f"| {w_p:.3f} | {wins}/{len(diffs)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
