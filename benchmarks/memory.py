"""Peak memory of SFL-V1 and FedAvg with K=100 clients vs K=10 on the same data.

Issue 2 asks for at most 1.5x: the sync server keeps a running weighted sum and the clients are
processed one after another, so no K model copies are alive. Each measurement runs one round in
a fresh process and reports that process's peak resident set size.

    .venv/bin/python benchmarks/memory.py [--samples 20000] [--model cnn]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def child(algorithm: str, clients: int, samples: int, model: str) -> None:
    from splitlab.engine import build
    from splitlab.process_settings import peak_memory_mib

    experiment = build(
        dict(
            algorithm=algorithm,
            dataset="fashion_mnist",
            model=model,
            cut=1,
            clients=clients,
            train_subset=samples,
            batch_size=64,
            optimizer="adam",
            device="cpu",
            seed=0,
        )
    )
    experiment.algorithm.run_round(0, experiment.clients)
    print(json.dumps({"peak_rss_mib": peak_memory_mib()}))


def measure(algorithm: str, clients: int, args: argparse.Namespace) -> float:
    out = subprocess.run(
        [sys.executable, __file__, "--child", algorithm, str(clients), str(args.samples), args.model],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.splitlines()[-1])["peak_rss_mib"]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--model", default="cnn")
    args = parser.parse_args()
    print(f"{args.samples} Fashion-MNIST samples, {args.model} cut 1, one round, peak RSS of a fresh process")
    for algorithm in ("fedavg", "sfl_v1", "sfl_v2"):
        small, large = measure(algorithm, 10, args), measure(algorithm, 100, args)
        print(f"  {algorithm:8s} K=10 {small:7.0f} MiB   K=100 {large:7.0f} MiB   ratio {large / small:.3f}")


if __name__ == "__main__":
    main()
