"""backend=ray against in-process: seconds per round, and each worker actor's peak memory in K.

Speed: FedAvg and SFL-V1 on Fashion-MNIST with the CNN (cut 1), K=100 clients, 20 per round, in
process and on a local Ray with `--workers` client actors (plus the training server's), side by
side in one run; only the rounds are timed (not building the roles or starting the actors), and
the final weights are checked to be bit-identical to the in-process run with one torch thread (as
each actor has).

Memory: the peak resident set size of every worker actor after one round of 10 clients, with K=10
and with K=1000 clients on the same samples. Each actor holds its clients' samples and a working
copy per client training at once, so it should be flat in K. (What crosses in a round goes
through Ray's shared-memory object store, which counts in an actor's resident set: hence the
same number of clients per round.)

    .venv/bin/python benchmarks/ray_clients.py [--rounds 2] [--workers 2] [--samples 20000]
"""

from __future__ import annotations

import argparse
import os
import time

import ray
import torch

from splitlab.assembly import Experiment
from splitlab.engine import build


def config(algorithm: str, clients: int, args: argparse.Namespace, per_round: int = 20, **overrides) -> dict:
    return dict(
        algorithm=algorithm,
        dataset="fashion_mnist",
        model="cnn",
        cut=1,
        clients=clients,
        participation=min(1.0, per_round / clients),
        train_subset=args.samples,
        batch_size=64,
        device="cpu",
        seed=0,
        **overrides,
    )


def timed_rounds(experiment: Experiment, rounds: int) -> float:
    """Seconds per round, as the engine samples clients (rounds 0..rounds-1)."""
    from splitlab.loop import STREAM_SAMPLING, sample_clients
    from splitlab.roles import random_stream

    cfg = experiment.config.run
    started = time.perf_counter()
    for rnd in range(rounds):
        clients = sample_clients(experiment.clients, cfg.participation, random_stream(cfg.seed, rnd, STREAM_SAMPLING))
        experiment.algorithm.run_round(rnd, clients)
    return (time.perf_counter() - started) / rounds


def weights(experiment: Experiment) -> dict[str, torch.Tensor]:
    return {name: t for state in experiment.algorithm.global_model() or [] for name, t in state.items()}


def speed(args: argparse.Namespace) -> None:
    """In process with torch's default threads and with one thread (what each actor uses, and the run
    Ray's is bit-identical to: torch's CPU kernels split some sums by thread count)."""
    threads = torch.get_num_threads()
    print(f"K=100, 20 clients per round, {args.samples} samples, cnn cut 1, {args.rounds} rounds timed")
    print(
        f"{'algorithm':10} {f'in process, {threads} threads':>24} {'in process, 1 thread':>22} "
        f"{f'ray, {args.workers} workers':>16} {'speedup':>16}  identical to 1 thread"
    )
    for algorithm in ("fedavg", "sfl_v1"):
        seconds, results = {}, {}
        for n in (threads, 1):
            torch.set_num_threads(n)
            local = build(config(algorithm, 100, args))
            seconds[n] = timed_rounds(local, args.rounds)
            results[n] = weights(local)
        torch.set_num_threads(threads)
        remote = build(config(algorithm, 100, args, backend="ray", workers=args.workers))
        remote.algorithm.client(0).snapshot("client_model")  # wait for the actors to be built
        ray_seconds = timed_rounds(remote, args.rounds)
        a, b = results[1], weights(remote)
        remote.transport.close()
        print(
            f"{algorithm:10} {seconds[threads]:22.2f} s {seconds[1]:20.2f} s {ray_seconds:14.2f} s "
            f"{seconds[threads] / ray_seconds:6.2f}x / {seconds[1] / ray_seconds:4.2f}x  "
            f"{all(torch.equal(a[k], b[k]) for k in a)}"
        )


def memory(args: argparse.Namespace) -> None:
    print(f"\npeak RSS of each worker actor after one round of 10 clients, {args.samples} samples")
    for algorithm in ("fedavg", "sfl_v1"):
        peaks = {}
        for clients in (10, 1000):
            experiment = build(config(algorithm, clients, args, per_round=10, backend="ray", workers=args.workers))
            timed_rounds(experiment, 1)
            hosts = experiment.transport.hosts[: args.workers]  # the client workers (the server is last)
            peaks[clients] = ray.get([host.peak_memory_mib.remote() for host in hosts])
            experiment.transport.close()
        print(
            f"{algorithm:10} K=10: {' '.join(f'{m:.0f}' for m in peaks[10])} MiB   "
            f"K=1000: {' '.join(f'{m:.0f}' for m in peaks[1000])} MiB   "
            f"ratio {max(peaks[1000]) / max(peaks[10]):.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args()
    # Ray starts its workers at nice 15 (raylet first); on a machine shared with other work that
    # starves the actors, and the comparison would measure the scheduler, not splitlab.
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    speed(args)
    memory(args)
    ray.shutdown()


if __name__ == "__main__":
    main()
