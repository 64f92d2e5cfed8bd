"""The network's cost: training rounds with client nodes in other processes over gRPC (loopback,
mutual TLS) against the same rounds in process (`splitlab run`'s direct transport).

Workload (issue 10): Fashion-MNIST, CNN cut 1, 3 clients, batch 32, SplitFed v2. The training
rounds alone are timed (`run_round`: no evaluation, no checkpoints), after one warm-up round,
with one torch thread in every process, all processes pinned to one CPU (`--cpu`): the
networked variant's processes take turns (each call waits for its reply), so on an idle machine
both use one core at a time, and pinning keeps it so on a busy one, where several processes
would otherwise get a larger share of the machine than one. The two variants alternate
`--repeats` times so that noise from other processes hurts both alike; medians are compared. Also measured: the
network's per-batch round trip (one `split_step`: smashed data up, server step, cut gradient
down), the round trip of an empty call, and the bytes of every protobuf message against the
ledger's count of the tensors that cross.

    .venv/bin/python benchmarks/network.py [--rounds 3] [--repeats 3] [--train-subset 3000] [--cpu 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = dict(
    algorithm="sfl_v2",
    dataset="fashion_mnist",
    model="cnn",
    cut=1,
    clients=3,
    batch_size=32,
    device="cpu",
    seed=0,
)


def timed_rounds(experiment, rounds: int) -> list[float]:
    """Seconds of each training round after a warm-up round, every client sampled."""
    algorithm, clients = experiment.algorithm, experiment.clients
    algorithm.run_round(0, clients)
    seconds = []
    for rnd in range(1, rounds + 1):
        started = time.perf_counter()
        algorithm.run_round(rnd, clients)
        seconds.append(time.perf_counter() - started)
    return seconds


def in_process(config: dict, rounds: int) -> list[float]:
    from splitlab.engine import build

    return timed_rounds(build(config), rounds)


def networked(config: dict, rounds: int, work: Path) -> dict:
    from splitlab.engine import build
    from splitlab.net.certs import make_certs
    from splitlab.net.launch import _free_port
    from splitlab.net.server import Hub, NetworkTransport, ServerSettings, client_config

    certs = work / "certs"
    if not certs.exists():
        make_certs(certs, config["clients"], [])
    address = f"127.0.0.1:{_free_port()}"
    hub = Hub(ServerSettings(listen=address, certs=certs), client_config(config))
    hub.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    clients = [
        subprocess.Popen(
            [sys.executable, "-m", "splitlab", "client", f"connect={address}", f"client_id={k}", f"certs={certs}"],
            env=env,
            stderr=subprocess.DEVNULL,
        )
        for k in range(config["clients"])
    ]
    try:
        experiment = build(config, transport=lambda ledger, device: NetworkTransport(ledger, device, hub))
        seconds = timed_rounds(experiment, rounds)
        ledger, algorithm = experiment.ledger, experiment.algorithm
        figures = {"seconds": seconds, "wire": ledger.wire_bytes, "ledger": ledger.total_bytes}
        proxy = algorithm.client(0)
        started = time.perf_counter()
        for _ in range(200):
            proxy.end_round()  # an empty call: the round trip alone
        figures["empty_call"] = (time.perf_counter() - started) / 200
        algorithm.run_round(rounds + 1, experiment.clients[:1])  # one client: its batches one after another
        split_step, steps = algorithm.split_step, []

        def timed_step(*args, **kwargs):
            started = time.perf_counter()
            split_step(*args, **kwargs)
            steps.append(time.perf_counter() - started)

        algorithm.split_step = timed_step
        algorithm.run_round(rounds + 2, experiment.clients[:1])
        figures["batch"] = statistics.median(steps)
        return figures
    finally:
        hub.close()
        for client in clients:
            client.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-subset", type=int, default=3000)
    parser.add_argument("--cpu", type=int, default=0, help="the CPU every process is pinned to")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.cpu})  # inherited by the client processes
    import torch

    torch.set_num_threads(1)
    config = {**WORKLOAD, "train_subset": args.train_subset, "test_subset": 100}
    local, network, last = [], [], {}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.repeats):
            local += in_process(config, args.rounds)
            last = networked(config, args.rounds, Path(work))
            network += last["seconds"]
    direct, net = statistics.median(local), statistics.median(network)
    batches = -(-args.train_subset // config["clients"] // config["batch_size"]) * config["clients"]
    print(f"workload: {config}")
    print(f"round (median of {len(local)}): in process {direct:.3f} s, network {net:.3f} s, ratio {net / direct:.2f}")
    print(f"per batch: in process {1000 * direct / batches:.1f} ms, network {1000 * net / batches:.1f} ms")
    print(f"one split step over the network (median): {1000 * last['batch']:.2f} ms")
    print(f"empty call round trip: {1000 * last['empty_call']:.3f} ms")
    print(
        f"wire bytes {last['wire']:,} vs ledger {last['ledger']:,}: "
        f"{100 * (last['wire'] / last['ledger'] - 1):+.2f}% (every protobuf message, handshakes, heartbeats included)"
    )


if __name__ == "__main__":
    main()
