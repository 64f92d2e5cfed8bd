"""Secure aggregation's cost per client: SecAgg's complete graph against SecAgg+'s sparse one (issue 44).

For each round size n, one round of sfl_v2 in process (synthetic data, the mlp cut after its first
layer: a client part of m = 13,000 float32 parameters) with `secure_aggregation=true`, once with
every client a neighbour of every other (SecAgg) and once with `secagg_neighbours=k`, k = log2 n
(SecAgg+). The ledger's `secagg_*` bytes over n are the protocol's bytes per client P (its keys,
sealed shares and unmasking, up and down; the graph is regular and no client drops, so every
client's are the same). The expansion is what a client sends and receives for its part with the
protocol over its part in the clear: (4m + P) / 4m, the masked input in the 32-bit ring being as
large as the float32 part. P does not depend on m, so the last column gives the expansion for a
part of 2^20 parameters from the same P. The wall time is the whole round's, training included,
in this one process (every client and the server: their computation, not one client's).

    nice .venv/bin/python benchmarks/secagg_cost.py [--clients 16 64 256]
"""

from __future__ import annotations

import argparse
import math
import time

from splitlab.engine import build


def measure(clients: int, neighbours: int | None) -> tuple[float, int, float]:
    """(protocol bytes per client, the averaged part's elements, seconds) of one round."""
    experiment = build(
        dict(
            dataset="synthetic",
            model="mlp",
            cut=1,
            algorithm="sfl_v2",
            clients=clients,
            train_subset=2 * clients,
            batch_size=2,
            local_steps=1,
            device="cpu",
            seed=0,
            secure_aggregation=True,
            secagg_neighbours=neighbours,
        )
    )
    start = time.perf_counter()
    experiment.algorithm.run_round(0, experiment.clients)
    seconds = time.perf_counter() - start
    protocol = sum(count for kind, count in experiment.ledger.bytes_by_kind.items() if kind.startswith("secagg_"))
    elements = sum(t.numel() for t in experiment.blueprint.initial_state("client_model").values())
    return protocol / clients, elements, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args()
    columns = [
        "n",
        "graph",
        "neighbours",
        "protocol bytes per client",
        "m",
        "expansion at m",
        "at m = 2^20",
        "round (s)",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for n in args.clients:
        k = 2 * round(math.log2(n) / 2)  # log2 n, made even
        for graph, neighbours in (("SecAgg (complete)", None), (f"SecAgg+ (k = {k})", k)):
            per_client, m, seconds = measure(n, neighbours)
            expansion, large = (4 * m + per_client) / (4 * m), (4 * 2**20 + per_client) / (4 * 2**20)
            degree = n - 1 if neighbours is None else neighbours
            row = [
                n,
                graph,
                degree,
                f"{per_client:,.0f}",
                f"{m:,}",
                f"{expansion:.3f}",
                f"{large:.4f}",
                f"{seconds:.1f}",
            ]
            print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
