"""SplitGP's Table II and III views on Fashion-MNIST (K=50, 2 label shards per client), at the
scale a CPU allows: trains SplitGP for each lambda, the multi-exit FedAvg baseline (SplitGP with
lambda=0) and FedAvg, then evaluates every run per client for each rho. Defaults are the paper's
(splitgp_cnn cut 4, SGD 0.01, batch 50, 120 rounds: GPU work); on a CPU, e.g.

    nice .venv/bin/python benchmarks/splitgp_table2.py --model mlp --cut 1 --rounds 40 --jobs 6

Writes <out>/<name>/ run directories (each with evaluation.json) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

LAMBDAS = (0.2, 0.3, 0.5, 0.9)
RHOS = "0,0.2,0.4,0.6,0.8"


def configs(args: argparse.Namespace) -> dict[str, dict]:
    common = dict(
        dataset="fashion_mnist",
        model=args.model,
        cut=args.cut,
        clients=50,
        partition="shards:2",
        optimizer="sgd",
        lr=args.lr,
        batch_size=50,
        rounds=args.rounds,
        train_subset=args.train_subset or None,
        test_subset=args.test_subset or None,
        eval_every=args.rounds,
        device="cpu",
        seed=args.seed,
    )
    runs = {
        f"splitgp_lambda{lam}": dict(common, algorithm="splitgp", gamma=0.5, personalization=lam) for lam in LAMBDAS
    }
    runs["multi_exit_fedavg"] = dict(common, algorithm="splitgp", gamma=0.5, personalization=0.0)
    runs["fedavg"] = dict(common, algorithm="fedavg", cut=1)
    return runs


def train_and_evaluate(job: tuple[str, dict, str, int]) -> tuple[str, dict]:
    name, config, out, validation_size = job
    torch.set_num_threads(1)
    from splitlab.engine import run
    from splitlab.splitgp_evaluation import evaluate_run

    run_dir = Path(out) / name
    summary = run({**config, "out": str(run_dir), "resume": True}, progress=False)
    evaluation = evaluate_run(run_dir, {"rho": RHOS, "validation_size": validation_size})
    return name, {"summary": summary, "evaluation": evaluation}


def table(rows: dict[str, list[float]], rhos: list[float]) -> str:
    lines = ["| method | " + " | ".join(f"rho={r}" for r in rhos) + " |", "|---" * (len(rhos) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{100 * a:.2f}%" for a in acc) + " |" for name, acc in rows.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="splitgp_cnn")
    parser.add_argument("--cut", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=120)
    parser.add_argument("--train-subset", type=int, default=0, help="0 = all 60,000")
    parser.add_argument("--test-subset", type=int, default=0, help="0 = all 10,000")
    parser.add_argument("--validation-size", type=int, default=200)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", default="runs/splitgp_table2")
    args = parser.parse_args()
    jobs = [(name, config, args.out, args.validation_size) for name, config in configs(args).items()]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = dict(pool.map(train_and_evaluate, jobs))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))

    rhos = results["fedavg"]["evaluation"]["rho"]
    fedavg, gp = results["fedavg"]["evaluation"]["rows"], results["splitgp_lambda0.2"]["evaluation"]["rows"]
    me = results["multi_exit_fedavg"]["evaluation"]["rows"]
    print("Table II view (mean per-client accuracy)\n")
    print(
        table(
            {
                "personalized FL (FedAvg + 1 local update)": fedavg["personalized"]["accuracy"],
                "generalized FL (FedAvg)": fedavg["generalized"]["accuracy"],
                "multi-exit FedAvg (gated)": me["splitgp"]["accuracy"],
                "SplitGP lambda=0.2": gp["splitgp"]["accuracy"],
                "  client model only": gp["client model"]["accuracy"],
                "  full model only": gp["full model"]["accuracy"],
                "  E_th chosen on test (reference)": gp["splitgp (E_th chosen on test)"]["accuracy"],
            },
            rhos,
        )
    )
    print(
        "\nE_th (auto) and fraction decided at the client, SplitGP lambda=0.2:",
        gp["splitgp"]["entropy_threshold"],
        [round(f, 3) for f in gp["splitgp"]["client_fraction"]],
    )
    print("\nTable III view (lambda ablation, SplitGP gated)\n")
    print(
        table(
            {
                f"lambda={lam}": results[f"splitgp_lambda{lam}"]["evaluation"]["rows"]["splitgp"]["accuracy"]
                for lam in LAMBDAS
            },
            rhos,
        )
    )
    print("\ntraining wall seconds:", {name: round(r["summary"]["wall_seconds"]) for name, r in results.items()})


if __name__ == "__main__":
    main()
