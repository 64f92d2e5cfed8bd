"""Framework overhead: one epoch of SFL-V2 vs centralized training over the same samples.

Issue 2 asks for at most 1.15x the wall time of centralized training with the same batch size, in
the same process run. Both algorithms see the same samples; evaluation is not timed. The two are
alternated and the fastest of `--repeats` epochs of each is compared, so that noise from other
processes on the machine hurts both alike.

    .venv/bin/python benchmarks/overhead.py [--samples 60000] [--clients 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

from splitlab.engine import build


def epoch_seconds(algorithm: str, args: argparse.Namespace, **extra) -> float:
    experiment = build(
        dict(
            algorithm=algorithm,
            dataset="fashion_mnist",
            model="cnn",
            cut=args.cut,
            clients=args.clients,
            train_subset=args.samples,
            batch_size=args.batch_size,
            optimizer="adam",
            device=args.device,
            seed=0,
            **extra,
        )
    )
    experiment.algorithm.run_round(0, experiment.clients[:1])  # warm-up (allocator, kernels)
    started = time.perf_counter()
    experiment.algorithm.run_round(1, experiment.clients)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60000)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--cut", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    runs = {"centralized": [], "sfl_v2 interleaved": [], "sfl_v2 sequential": []}
    for _ in range(args.repeats):
        runs["centralized"].append(epoch_seconds("centralized", args))
        runs["sfl_v2 interleaved"].append(epoch_seconds("sfl_v2", args))
        runs["sfl_v2 sequential"].append(epoch_seconds("sfl_v2", args, server_schedule="sequential"))
    base = min(runs["centralized"])
    print(
        f"{args.samples} Fashion-MNIST samples, cnn cut {args.cut}, batch {args.batch_size}, "
        f"K={args.clients}, best of {args.repeats}"
    )
    for name, seconds in runs.items():
        print(
            f"  {name:20s} {min(seconds):7.2f} s/epoch  ratio {min(seconds) / base:.3f}   "
            f"(all: {', '.join(f'{s:.2f}' for s in seconds)})"
        )


if __name__ == "__main__":
    main()
