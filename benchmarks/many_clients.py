"""Many small clients: splitlab's FedAvg round against a plain-torch loop over the same batches (issue 45).

Workloads: K clients, C of them sampled per round (K=100/10, K=100/100, K=1000/100), FedAvg,
1 local epoch, batch 32, SGD, IID shares of the dataset's training samples. For each workload
splitlab runs with `vectorize=false` and `vectorize=true`, and a plain-torch loop written here
trains the very clients splitlab samples, on the very batches their nodes draw (client order and
sample indices are read from the built experiment), with bare modules: the global weights copied
into one working model per client, one reused `torch.optim.SGD`, the weighted average summed into
one flat buffer. Warm rounds only (a first round of each side runs untimed), evaluation left
out; the sides take turns round by round (who goes first alternating), `--repeats` turns of
`--rounds` rounds each, and medians of the per-turn times are compared. Ratio = splitlab seconds /
plain seconds, so 1.0 means as fast and below 1 faster.

Models (`--models`): `mlp` (784-200-200-10 on Fashion-MNIST), `digits` (the MLP on the 8x8
digits), `cnn` (the FEMNIST-shaped LEAF CNN on Fashion-MNIST's 28x28 images) and `resnet9`
(CycleSL's ResNet-9 on CIFAR-10, whose files it needs). `--device cuda` runs every
side on the GPU (synchronised before each clock read). `--algorithms sfl_v1 sfl_v2 psl cse_fsl fsl_sage`
times the other algorithms that run vectorize=true (at their default settings) the same way,
sequential against vectorized, without a plain loop.

    .venv/bin/python benchmarks/many_clients.py [--algorithms fedavg] [--models mlp]
        [--workloads 100/10 100/100 1000/100] [--rounds 3] [--repeats 3] [--threads 1] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from splitlab.engine import build
from splitlab.errors import UserError
from splitlab.loop import STREAM_SAMPLING, sample_clients
from splitlab.roles import STREAM_BATCHES, random_stream

MODELS = {
    "mlp": dict(dataset="fashion_mnist", model="mlp"),
    "digits": dict(dataset="digits", model="mlp"),
    "cnn": dict(dataset="fashion_mnist", model="cnn"),
    "resnet9": dict(dataset="cifar10", model="resnet9"),
}


def config(algorithm: str, model: str, clients: int, per_round: int, args: argparse.Namespace, vectorize: bool) -> dict:
    return dict(
        algorithm=algorithm,
        **MODELS[model],
        clients=clients,
        participation=per_round / clients,
        partition="iid",
        local_epochs=1,
        batch_size=32,
        optimizer="sgd",
        lr=0.05,
        device=args.device,
        seed=0,
        rounds=args.rounds * (2 * args.repeats + 1) + 1,
        **(dict(vectorize=True, cohort_size=args.cohort_size) if vectorize else {}),
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Splitlab:
    """A built run whose rounds are timed one at a time, with the clients the run's loop samples."""

    def __init__(self, cfg: dict) -> None:
        self.experiment = build(cfg)
        self.cfg = self.experiment.config.run
        self.round = 0

    def sampled(self, rnd: int):
        return sample_clients(
            self.experiment.clients, self.cfg.participation, random_stream(self.cfg.seed, rnd, STREAM_SAMPLING)
        )

    def rounds(self, count: int) -> float:
        sync(self.cfg.device)
        started = time.perf_counter()
        for _ in range(count):
            self.experiment.algorithm.run_round(self.round, self.sampled(self.round))
            self.round += 1
        sync(self.cfg.device)
        return time.perf_counter() - started

    def weights(self) -> torch.Tensor:
        """The global model's first part (PSL's: the server part, its clients keep their own)."""
        return torch.cat([t.flatten().float() for t in self.experiment.algorithm.shared_model()[0].values()])


class PlainLoop:
    """FedAvg written directly in torch over the clients and batches of `run`'s rounds."""

    def __init__(self, run: Splitlab) -> None:
        self.run = run
        blueprint = run.experiment.blueprint
        nodes = run.experiment.roles.clients
        self.inputs = [node.inputs(node.x) for node in nodes]  # every client's samples, prepared once
        self.labels = [node.y for node in nodes]
        self.global_model = blueprint.new_model()
        self.params = list(self.global_model.parameters())
        self.work = blueprint.new_model()
        self.work_params = list(self.work.parameters())
        self.optimizer = torch.optim.SGD(self.work_params, lr=run.cfg.lr, foreach=True)
        self.total = [torch.zeros_like(p) for p in self.params]
        self.round = 0

    def rounds(self, count: int) -> float:
        sync(self.run.cfg.device)
        started = time.perf_counter()
        for _ in range(count):
            self.one_round(self.round)
            self.round += 1
        sync(self.run.cfg.device)
        return time.perf_counter() - started

    @torch.no_grad()
    def one_round(self, rnd: int) -> None:
        clients = self.run.sampled(rnd)
        samples = sum(c.num_samples for c in clients)
        for total in self.total:
            total.zero_()
        for client in clients:
            torch._foreach_copy_(self.work_params, self.params)
            x, y = self.inputs[client.id], self.labels[client.id]
            order = random_stream(self.run.cfg.seed, rnd, STREAM_BATCHES, client.id, 0).permutation(len(y))
            for idx in torch.as_tensor(order, device=y.device).split(32):
                with torch.enable_grad():
                    loss = F.cross_entropy(self.work(x[idx]), y[idx])
                    self.optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                self.optimizer.step()
            torch._foreach_add_(self.total, self.work_params, alpha=client.num_samples / samples)
        torch._foreach_copy_(self.params, self.total)


def measure(algorithm: str, model: str, clients: int, per_round: int, args: argparse.Namespace) -> None:
    """One workload's sides timed in turns: splitlab's sequential and vectorized runs, and for FedAvg the plain loop."""
    sequential = Splitlab(config(algorithm, model, clients, per_round, args, False))
    sides: dict[str, Splitlab | PlainLoop] = {"sequential": sequential}
    if algorithm == "fedavg":
        sides = {"plain": PlainLoop(sequential), **sides}
    refused = ""
    if not args.no_vectorize:
        try:
            sides["vectorized"] = Splitlab(config(algorithm, model, clients, per_round, args, True))
            sides["vectorized"].rounds(1)  # warm, and where the model is checked
        except UserError as error:  # a model vectorize=true cannot run (BatchNorm, dropout)
            sides.pop("vectorized", None)
            refused = f"  vectorized: {error}"
    for name in sides.keys() - {"vectorized"}:
        sides[name].rounds(1)  # warm: allocator, kernels, first optimizers (vectorized: above)
    times: dict[str, list[float]] = {name: [] for name in sides}
    for repeat in range(args.repeats):
        order = list(sides) if repeat % 2 == 0 else list(reversed(sides))
        for name in order:
            times[name].append(sides[name].rounds(args.rounds) / args.rounds)
    line = f"  {algorithm:8s} {model:7s} K={clients:<5d} {per_round:>4d}/round"
    for name in sides:
        median = statistics.median(times[name])
        line += f"  {name} {median * 1000:8.1f} ms"
        if name != "plain" and "plain" in times:
            line += f" ({median / statistics.median(times['plain']):.3f}x)"
    if "vectorized" in sides:
        speedup = statistics.median(times["sequential"]) / statistics.median(times["vectorized"])
        line += f"  vectorize speed-up {speedup:.2f}x"
        gap = (sides["vectorized"].weights() - sequential.weights()).abs().max()
        line += f"  max |w_vec - w_seq| {float(gap):.1e}"
    print(line + refused, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=list(MODELS))
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["fedavg"],
        choices=("fedavg", "sfl_v1", "sfl_v2", "psl", "cse_fsl", "fsl_sage"),
        help="those that run vectorize=true; the plain loop is FedAvg's only",
    )
    parser.add_argument("--workloads", nargs="+", default=["100/10", "100/100", "1000/100"], help="K/per-round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per timed turn")
    parser.add_argument("--repeats", type=int, default=3, help="timed turns per side (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, fixed for every side")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--cohort-size", type=int, default=None, help="vectorize: clients per batched computation")
    parser.add_argument("--no-vectorize", action="store_true", help="only the sequential path against the loop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    print(
        f"1 local epoch, batch 32, SGD, IID; {args.rounds} warm rounds per turn, median of {args.repeats} "
        f"interleaved turns; torch threads {args.threads}, device {args.device}; ratio = splitlab / plain seconds"
    )
    for algorithm in args.algorithms:
        for model in args.models:
            for workload in args.workloads:
                clients, per_round = (int(v) for v in workload.split("/"))
                measure(algorithm, model, clients, per_round, args)


if __name__ == "__main__":
    main()
