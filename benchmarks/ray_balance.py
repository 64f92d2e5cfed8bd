"""backend=ray: how evenly the client workers share the clients' work (issue 26).

FedAvg on the synthetic dataset, K clients of which 10 train each round, on `workers` client
workers. Two schedules in one Ray: clients going to whichever worker is free (splitlab's), and
client k pinned to worker k mod `workers` (what it did before: a client waits for its worker).
For each, from the runs' `ray_worker_seconds` and the workers the scheduler picked:

- per round, the busiest worker's seconds over the mean worker's (10 clients on 8 workers: at
  best 2 / 1.25 = 1.6, two workers must take two clients) and the round's wall seconds;
- over the run, the busiest worker's total seconds and clients over the mean.

    .venv/bin/python benchmarks/ray_balance.py [--clients 100] [--rounds 10] [--workers 8] [--local-epochs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import ray
import torch

from splitlab import ray_backend
from splitlab.engine import run


def pinned(self: ray_backend.RayTransport, client: ray_backend.RemoteRole) -> int | None:
    """Client k on worker k mod workers only (its first worker): it waits until that one is free."""
    return client.worker if client.worker in self._free else None


def measure(args: argparse.Namespace, schedule: str) -> dict:
    picked: Counter[int] = Counter()
    choose = pinned if schedule == "pinned" else ray_backend.RayTransport._pick

    def counting(self: ray_backend.RayTransport, client: ray_backend.RemoteRole) -> int | None:
        worker = choose(self, client)
        if worker is not None:
            picked[worker] += 1
        return worker

    ray_backend.RayTransport._pick = counting  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        config = dict(
            algorithm="fedavg",
            dataset="synthetic",
            model="mlp",
            clients=args.clients,
            participation=10 / args.clients,
            rounds=args.rounds,
            local_epochs=args.local_epochs,
            batch_size=4,
            device="cpu",
            seed=0,
            checkpoint_every=0,
            backend="ray",
            workers=args.workers,
            out=str(Path(tmp) / "out"),
        )
        run(config, progress=False)
        rows = [json.loads(line) for line in (Path(tmp) / "out" / "metrics.jsonl").read_text().splitlines()]
    seconds = np.array([row["ray_worker_seconds"] for row in rows])
    totals, clients = seconds.sum(axis=0), np.array([picked[w] for w in range(args.workers)])
    return {
        "per_round": [float(r.max() / r.mean()) for r in seconds],
        "round_seconds": [row["wall_seconds"] for row in rows],
        "seconds": float(totals.max() / totals.mean()),
        "clients": float(clients.max() / clients.mean()),
        "moves": sum(row["ray_client_moves"] for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--local-epochs", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("RAY_worker_niceness", "0")  # docs/ray.md: Ray's nice 15 starves actors on a busy machine
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    print(f"fedavg, K={args.clients}, 10 clients a round, {args.rounds} rounds, {args.workers} workers")
    print("schedule | busiest/mean per round (median, max) | round s (median) | run: seconds, clients | moves")
    for schedule in ("free", "pinned"):
        m = measure(args, schedule)
        print(
            f"{schedule:8} | {np.median(m['per_round']):6.2f} {max(m['per_round']):6.2f}"
            f"                         | {np.median(m['round_seconds']):8.2f}"
            f"         | {m['seconds']:5.2f} {m['clients']:5.2f}         | {m['moves']}"
        )


if __name__ == "__main__":
    main()
