"""backend=ray against in-process for PSL with many clients (the synthetic dataset's 1200 samples): wall time, and driver-actor bytes per round.

PSL keeps a personal client model per client; every evaluation averages the test metrics of all K
personal models. On Ray these are evaluated on the actors that hold them (only metrics travel),
so the driver-actor traffic per round should not grow with K and the wall time should stay
within 2x of the in-process run (issue 26). Both sides end to end through `engine.run` (building
the roles and starting the actors included), the in-process one with one torch thread as each
actor has; the rows' test metrics are checked to be identical.

    .venv/bin/python benchmarks/ray_psl.py [--clients 1000] [--rounds 3] [--workers 2] [--small 100]
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
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--small", type=int, default=100, help="a smaller K, for driver-actor bytes against K")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        local_s, local_rows = timed(config(args.clients, args.rounds, Path(tmp) / "local"))
        ray_s, ray_rows = timed(config(args.clients, args.rounds, Path(tmp) / "ray", backend="ray", workers=args.workers))
        _, small_rows = timed(config(args.small, args.rounds, Path(tmp) / "small", backend="ray", workers=args.workers))
    same = [{k: r[k] for k in METRICS} for r in local_rows] == [{k: r[k] for k in METRICS} for r in ray_rows]
    print(f"psl K={args.clients}, {args.rounds} rounds, 10 clients per round, workers={args.workers}")
    print(f"  in process (1 thread): {local_s:.1f} s end to end (loop {local_rows[-1]['wall_seconds']:.1f} s)")
    print(f"  on Ray:                {ray_s:.1f} s end to end (loop {ray_rows[-1]['wall_seconds']:.1f} s)")
    print(f"  ratio Ray / in process: {ray_s / local_s:.2f} end to end, same metrics: {same}")
    print(f"  modelled bytes per round (K={args.clients}): {[r['comm_bytes'] for r in ray_rows]} (cumulative)")
    for k, rows in ((args.small, small_rows), (args.clients, ray_rows)):
        print(f"  driver-actor bytes per round, K={k}: {[r['driver_actor_bytes'] for r in rows]}")
    ray.shutdown()


if __name__ == "__main__":
    main()
