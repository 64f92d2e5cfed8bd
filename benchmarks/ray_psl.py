"""backend=ray against in-process for PSL with many clients (the synthetic dataset's 1200 samples): wall time, and driver-actor bytes per round.

PSL keeps a personal client model per client; every evaluation averages the test metrics of all K
personal models. On Ray these are evaluated on the actors that hold them (only metrics travel),
so the driver-actor traffic per round should not grow with K and the wall time should stay
within 2x of the in-process run (issue 26). Both sides end to end through `engine.run` (building
the roles and starting the actors included), the in-process one with one torch thread as each
actor has; the rows' test metrics are checked to be identical.

    .venv/bin/python benchmarks/ray_psl.py [--clients 100 1000] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import ray
import torch

from splitlab.engine import run

METRICS = ("test_accuracy", "test_loss", "comm_bytes")


def config(clients: int, rounds: int, out: Path, **overrides) -> dict:
    return dict(
        algorithm="psl",
        dataset="synthetic",
        model="mlp",
        clients=clients,
        participation=10 / clients,
        rounds=rounds,
        batch_size=10,
        device="cpu",
        seed=0,
        checkpoint_every=0,
        out=str(out),
        **overrides,
    )


def timed(cfg: dict) -> tuple[float, list[dict]]:
    started = time.perf_counter()
    run(cfg, progress=False)
    rows = [json.loads(line) for line in (Path(cfg["out"]) / "metrics.jsonl").read_text().splitlines()]
    return time.perf_counter() - started, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    print(f"psl, {args.rounds} rounds of 10 clients, evaluated every round, workers={args.workers}")
    print("     K | in process: end to end, loop per round | Ray: end to end, loop per round | ratio | same")
    bytes_per_round = {}
    for k in args.clients:
        with tempfile.TemporaryDirectory() as tmp:
            local_s, local_rows = timed(config(k, args.rounds, Path(tmp) / "local"))
            ray_s, ray_rows = timed(config(k, args.rounds, Path(tmp) / "ray", backend="ray", workers=args.workers))
        same = [{m: r[m] for m in METRICS} for r in local_rows] == [{m: r[m] for m in METRICS} for r in ray_rows]
        local_round, ray_round = (rows[-1]["wall_seconds"] / args.rounds for rows in (local_rows, ray_rows))
        print(
            f"{k:6d} | {local_s:10.1f} s {local_round:10.2f} s           | {ray_s:7.1f} s {ray_round:10.2f} s"
            f"      | {ray_s / local_s:5.2f} | {same}"
        )
        bytes_per_round[k] = [row["driver_actor_bytes"] for row in ray_rows]
    for k, figures in bytes_per_round.items():
        print(f"driver-actor bytes per round, K={k}: {figures}")
    ray.shutdown()


if __name__ == "__main__":
    main()
