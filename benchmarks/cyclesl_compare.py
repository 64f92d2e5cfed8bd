"""CycleSL versions against their originals (issue 4's measurement), over seeds.

    nice .venv/bin/python benchmarks/cyclesl_compare.py [--rounds 200] [--seeds 0 1 2] [--out runs/cyclesl_compare]
    nice .venv/bin/python benchmarks/cyclesl_compare.py --dataset shakespeare ...

Fashion-MNIST (the 2x200 MLP cut after its first layer: the LEAF CNN is too slow on a 2-core CPU): 100 clients, Dirichlet 0.1 over a 6000-sample pool, 5% participation, the
sample-wise 90/10 per-client test split of the CycleSL paper. batch_size=256 exceeds every
client's training data (at most ~220 samples), so every method takes exactly one batch per sampled
client per round: the protocol of the CycleSL authors' code, for originals and cycle versions
alike. Prints mean ± std of the final and best test accuracy and of rounds-to-target; each run's
files are kept under --out (a finished run is not recomputed).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from splitlab.engine import run

ALGORITHMS = ["fedavg", "sfl_v1", "sfl_v2", "psl", "sglr", "cycle_sfl", "cycle_psl", "cycle_sglr"]
CYCLE_PARAMS = dict(server_epochs=1, server_batch_size=64)
SETTINGS = {
    "fashion_mnist": dict(dataset="fashion_mnist", model="mlp", cut=1, clients=100, partition="dirichlet:0.1",
                          train_subset=6000, participation=0.05, test_split="client:0.1", batch_size=256,
                          optimizer="adam", lr=1e-3, target_accuracy=0.6, eval_every=5),
    # LEAF's natural (play, role) clients; every role's held-out windows pooled as the test set.
    "shakespeare": dict(dataset="shakespeare", model="lstm", cut=1, clients="all", participation=0.05,
                        batch_size=32, optimizer="adam", lr=3e-3, test_subset=2000, target_accuracy=0.35,
                        eval_every=10),
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
    args = parser.parse_args()

    print(f"| algorithm | final accuracy | best accuracy | rounds to {SETTINGS[args.dataset]['target_accuracy']:.0%} "
          f"(reached/seeds) | GiB | wall s |")
    print("|---|---|---|---|---|---|")
    for algorithm in args.algorithms:
        summaries = []
        for seed in args.seeds:
            config = {**SETTINGS[args.dataset], "algorithm": algorithm, "rounds": args.rounds, "seed": seed,
                      "device": "cpu", "resume": True,
                      "out": str(Path(args.out) / args.dataset / f"{algorithm}_seed{seed}")}
            if algorithm.startswith("cycle_"):
                config.update(CYCLE_PARAMS)
            summaries.append(run(config, progress=False))
        reached = [s["rounds_to_target"] for s in summaries if s["rounds_to_target"] is not None]
        print(f"| {algorithm} | {mean_std([s['final_accuracy'] for s in summaries])} "
              f"| {mean_std([s['best_accuracy'] for s in summaries])} "
              f"| {mean_std(reached)} ({len(reached)}/{len(summaries)}) "
              f"| {statistics.mean(s['total_gib'] for s in summaries):.3f} "
              f"| {statistics.mean(s['wall_seconds'] for s in summaries):.0f} |", flush=True)


if __name__ == "__main__":
    main()
