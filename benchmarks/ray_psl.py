"""backend=ray against in-process for PSL with many clients: wall time, the slowest single remote call,
and driver-actor bytes per round.

PSL keeps a personal client model per client; every evaluation averages the test metrics of all K
personal models. On Ray these are evaluated on the actors that hold them (only metrics travel),
so the driver-actor traffic per round should not grow with K and the wall time should stay
within 2x of the in-process run (issue 26). The synthetic dataset's 1200 samples; both sides end
to end through `engine.run` (building the roles and starting the actors included, starting Ray
itself not), each run in a fresh process, the in-process one with one torch thread as each actor
has; the rows' test metrics are checked to be identical.

    .venv/bin/python benchmarks/ray_psl.py [--clients 100 1000] [--rounds 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

from splitlab import ray_backend
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


def slowest_remote_call() -> list[float]:
    """Time every verb call to an actor from now on; the list holds the slowest so far (seconds).
    The audit of issue 26 saw a ~1 s stall in about one round in three (torch._dynamo imported by
    each actor's first optimizer step, now imported while the actors start)."""
    call, slowest = ray_backend.RemoteVerb.__call__, [0.0]

    def timed(self: ray_backend.RemoteVerb, request: bytes) -> bytes:
        started = time.perf_counter()
        reply = call(self, request)
        slowest[0] = max(slowest[0], time.perf_counter() - started)
        return reply

    ray_backend.RemoteVerb.__call__ = timed  # type: ignore[method-assign]
    return slowest


def one(clients: int, rounds: int, backend: str, workers: int) -> dict:
    """One run in this (fresh) process: seconds end to end, the actors' start, the slowest remote
    call, and its rows."""
    torch.set_num_threads(1)
    slowest = slowest_remote_call()
    if backend == "ray":
        # Ray starts its workers at nice 15; on a shared machine that starves the actors (docs/ray.md)
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(num_cpus=workers + 1, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        extra = {"backend": "ray", "workers": workers} if backend == "ray" else {}
        cfg = config(clients, rounds, Path(tmp) / "out", **extra)
        started = time.perf_counter()
        run(cfg, progress=False)
        seconds = time.perf_counter() - started
        rows = [json.loads(line) for line in (Path(tmp) / "out" / "metrics.jsonl").read_text().splitlines()]
    startup = rows[0].get("ray_startup_seconds", 0.0)
    return {"seconds": seconds, "startup": startup, "slowest_call": slowest[0], "rows": rows}


def in_fresh_process(clients: int, rounds: int, backend: str, workers: int) -> dict:
    """`one` in a new Python process: neither side inherits imports, warm-up or heap from the other."""
    command = [
        sys.executable,
        __file__,
        "--one",
        str(clients),
        backend,
        "--rounds",
        str(rounds),
        "--workers",
        str(workers),
    ]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--one", nargs=2, metavar=("K", "BACKEND"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one[0]), args.rounds, args.one[1], args.workers)))
        return
    print(f"psl, {args.rounds} rounds of 10 clients, evaluated every round, workers={args.workers}, fresh processes")
    print("     K | in process | Ray (actors' start) | Ray / in process | without the start | slowest call | same")
    bytes_per_round = {}
    for k in args.clients:
        local = in_fresh_process(k, args.rounds, "local", args.workers)
        remote = in_fresh_process(k, args.rounds, "ray", args.workers)
        same = [{m: r[m] for m in METRICS} for r in local["rows"]] == [
            {m: r[m] for m in METRICS} for r in remote["rows"]
        ]
        ratio, without_start = (
            seconds / local["seconds"] for seconds in (remote["seconds"], remote["seconds"] - remote["startup"])
        )
        print(
            f"{k:6d} | {local['seconds']:8.1f} s | {remote['seconds']:6.1f} s ({remote['startup']:5.1f} s)   |"
            f" {ratio:16.2f} | {without_start:17.2f} | {remote['slowest_call'] * 1000:9.0f} ms | {same}"
        )
        bytes_per_round[k] = [row["driver_actor_bytes"] for row in remote["rows"]]
    for k, figures in bytes_per_round.items():
        print(f"driver-actor bytes per round, K={k}: {figures}")


if __name__ == "__main__":
    main()
