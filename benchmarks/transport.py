"""The role boundary's cost: training throughput through the `direct` and `serialized` transports,
and against a baseline checkout of splitlab (e.g. the commit before the roles existed).

Workload (issue 9): Fashion-MNIST, LEAF CNN cut 2, 20 clients, one batch of 32 per client per
round, Adam; the training rounds alone are timed (no evaluation, no files). Every measurement runs
in a fresh process with one torch thread, and the variants are interleaved `--repeats` times, so
that noise from other processes hurts all alike; medians are compared.

    .venv/bin/python benchmarks/transport.py [--algorithms sfl_v2 cycle_sfl] [--rounds 100] [--repeats 5]
        [--baseline PATH]   # src/ of another checkout: git worktree add /tmp/base <rev>; --baseline /tmp/base/src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKLOAD = dict(
    dataset="fashion_mnist",
    model="cnn",
    cut=2,
    clients=20,
    train_subset=12000,
    batch_size=32,
    local_steps=1,
    optimizer="adam",
    device="cpu",
    seed=0,
)


def child(algorithm: str, transport: str | None, rounds: int) -> None:
    import torch

    from splitlab.engine import build

    torch.set_num_threads(1)
    config = dict(WORKLOAD, algorithm=algorithm, **({"transport": transport} if transport else {}))
    experiment = build(config)
    algorithm_ = experiment.algorithm
    step = getattr(algorithm_, "run_round", None) or algorithm_.train_round  # the baseline has train_round only
    carried = []
    if transport == "serialized":
        from splitlab.transport import SerializedTransport

        original = SerializedTransport._carry

        def counting(self, message):
            carried.append(1)
            return original(self, message)

        SerializedTransport._carry = counting
    step(0, experiment.clients)  # warm-up
    carried.clear()
    started = time.perf_counter()
    for rnd in range(1, rounds + 1):
        step(rnd, experiment.clients)
    seconds = time.perf_counter() - started
    ledger = experiment.ledger if hasattr(experiment, "ledger") else algorithm_.channel.ledger
    print(
        json.dumps(
            {
                "seconds_per_round": seconds / rounds,
                "messages_per_round": len(carried) / rounds,
                "envelope_bytes_per_round": getattr(ledger, "envelope_bytes", 0) / (rounds + 1),
            }
        )
    )


def measure(algorithm: str, transport: str | None, src: str, rounds: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", algorithm, transport or "-", str(rounds)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    ).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], None if sys.argv[3] == "-" else sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=["sfl_v2", "cycle_sfl"])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="src/ directory of the splitlab to compare with")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent.parent / "src")
    variants = {"direct": ("direct", here), "serialized": ("serialized", here)}
    if args.baseline:
        variants = {"baseline": (None, args.baseline), **variants}
    print(f"workload: {WORKLOAD}; {args.rounds} rounds, median of {args.repeats} interleaved fresh processes")
    for algorithm in args.algorithms:
        results: dict[str, list[dict]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, (transport, src) in variants.items():
                results[name].append(measure(algorithm, transport, src, args.rounds))
        median = {name: statistics.median(r["seconds_per_round"] for r in rows) for name, rows in results.items()}
        reference = median.get("baseline", median["direct"])
        for name, rows in results.items():
            ratio = median[name] / reference
            line = f"  {algorithm:10s} {name:10s} {1000 * median[name]:8.2f} ms/round  ratio {ratio:.3f}"
            if name == "serialized":
                messages = rows[0]["messages_per_round"]
                extra = median[name] - median["direct"]
                line += (
                    f"  {messages:.0f} messages/round, {rows[0]['envelope_bytes_per_round'] / 2**20:.2f} MiB/round, "
                    f"+{1e6 * extra / messages:.0f} us/message"
                )
            print(line)


if __name__ == "__main__":
    main()
