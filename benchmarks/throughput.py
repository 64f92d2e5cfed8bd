"""Whole-run training throughput and peak memory of splitlab vs a plain-torch loop (issue 14).

Throughput: Fashion-MNIST, 20 clients, one batch of 32 per client per round, LEAF CNN (`cnn`) cut 2,
Adam, for sfl_v2, sfl_v1, fedavg, cycle_sfl and fsl_sage. The plain-torch loop is written here: the
same model definitions (`splitlab.models`), the run's samples as one float32 tensor, and the very
batches splitlab draws (the same client order and sample indices, read from the built experiment
before timing), trained with bare `nn.Module`s and `torch.optim.Adam`. Every run is a fresh
process, as a `splitlab` command is (in one process the second run reused the heap pages the
first had faulted in, which favoured whichever ran second); the two sides alternate, who goes
first alternating too, `--repeats` times, and medians are compared:

  round loop   splitlab's summary `wall_seconds` (the time inside `run_round`) vs the loop's
  end to end   `splitlab.engine.run` (build, rounds, checkpoints every `checkpoint_every` s, evaluation, files) vs
               the loop plus building its models and one test evaluation

The dataset parse and the schedule come first in both sides' processes, untimed. Both sides run
with the allocator setting of every process the `splitlab` command starts (`splitlab.process_settings`:
glibc keeps freed memory for reuse instead of page-faulting it in again), so the ratio measures
splitlab's own work; `--malloc default` runs both with glibc's own thresholds.

Peak RSS (`--rss`): one round of sfl_v2 over a 12k-sample Fashion-MNIST run with 8 clients, a whole
local epoch each, vs the plain loop over the same-sized data held as float32, each in a fresh
process (`splitlab.process_settings.peak_memory_mib`: Linux's VmHWM, as benchmarks/memory.py measures
it). Issue 14 asks for <= 1.2x.

    .venv/bin/python benchmarks/throughput.py [--rounds 30] [--repeats 3] [--threads 1] [--rss] [--malloc reuse|default]
"""

from __future__ import annotations

import argparse
import copy
import gzip
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ALGORITHMS = ("sfl_v2", "sfl_v1", "fedavg", "cycle_sfl", "fsl_sage")
FASHION = Path("/usr/share/datasets/fashion-mnist")
MEAN, STD = 0.2860, 0.3530


def workload(algorithm: str, args: argparse.Namespace, out: str) -> dict:
    return dict(
        algorithm=algorithm,
        dataset="fashion_mnist",
        model="cnn",
        cut=2,
        clients=20,
        batch_size=32,
        local_steps=1,
        train_subset=args.samples,
        optimizer="adam",
        lr=1e-3,
        device="cpu",
        seed=0,
        rounds=args.rounds,
        eval_every=args.rounds,
        out=out,
        overwrite=True,
    )


# --- the plain-torch loop ----------------------------------------------------------------------


def schedule(config: dict) -> tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, torch.Tensor]]]]:
    """The run's samples (float32, all prepared, client after client) and per round the (client,
    sample indices) of every batch in splitlab's order, taken from the built experiment's roles."""
    from splitlab.algorithms.base import STREAM_ORDER
    from splitlab.engine import build
    from splitlab.roles import STREAM_BATCHES

    experiment = build(config)
    nodes, blueprint = experiment.roles.clients, experiment.blueprint
    offsets = np.cumsum([0] + [node.num_samples for node in nodes])
    plan = []
    for rnd in range(config["rounds"]):
        order = [int(k) for k in blueprint.rng(rnd, STREAM_ORDER, 0).permutation(len(nodes))]  # step 0
        plan.append(
            [
                (
                    k,
                    torch.as_tensor(
                        offsets[k]
                        + blueprint.rng(rnd, STREAM_BATCHES, nodes[k].id, 0).permutation(nodes[k].num_samples)[
                            : config["batch_size"]
                        ]
                    ),
                )
                for k in order
            ]
        )  # epoch 0: the first batch of the client's permutation
    return torch.cat([node.inputs(node.x) for node in nodes]), torch.cat([node.y for node in nodes]), plan


def adam(module: nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(module.parameters(), lr=1e-3, foreach=True)


def accumulate(total: dict | None, module: nn.Module) -> dict:
    """Running sum of `module`'s state (equal weights: the caller divides by the count)."""
    if total is None:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    for k, v in module.state_dict().items():
        total[k].add_(v)
    return total


def load_mean(target: nn.Module, total: dict, count: int) -> None:
    target.load_state_dict({k: v.div_(count) for k, v in total.items()})


def average_into(target: nn.Module, modules: list[nn.Module]) -> None:
    total = None
    for module in modules:
        total = accumulate(total, module)
    load_mean(target, total, len(modules))


def cut_grad(server: nn.Module, z: torch.Tensor, y: torch.Tensor, create_graph: bool = False) -> torch.Tensor:
    z = z.detach().requires_grad_()
    (grad,) = torch.autograd.grad(F.cross_entropy(server(z), y), z, create_graph=create_graph)
    return grad


class PlainLoop:
    """One algorithm's rounds written directly in torch (equal client weights: iid equal shares)."""

    def __init__(self, algorithm: str) -> None:
        from splitlab.models import build_model, split
        from splitlab.models.aux import build_aux

        self.algorithm = algorithm
        model = build_model("cnn", (1, 28, 28), 10, seed=0)
        self.model = model
        self.client, self.server = split(copy.deepcopy(model), 2)
        self.server_opt = adam(self.server)
        self.copies = [copy.deepcopy(self.client) for _ in range(20)]
        self.server_copy = copy.deepcopy(self.server)  # SFL-V1's per-client server part, reused
        if algorithm == "fsl_sage":
            self.aux = [
                build_aux("stage", build_model("cnn", (1, 28, 28), 10, seed=0), 2, (1, 28, 28)) for _ in range(20)
            ]
            self.buffers: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(20)]

    def round(self, rnd: int, batches: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        getattr(self, self.algorithm)(rnd, batches)

    def fedavg(self, rnd, batches):
        """Clients one after another on one working model; the average is a running sum."""
        whole = nn.Sequential(self.client, self.server)
        self._local = getattr(self, "_local", None) or copy.deepcopy(whole)
        total = None
        for _, x, y in batches:
            self._local.load_state_dict(whole.state_dict())
            opt = adam(self._local)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(self._local(x), y).backward()
            opt.step()
            total = accumulate(total, self._local)
        load_mean(whole, total, len(batches))

    def sfl_v1(self, rnd, batches):
        """Clients one after another, each with a fresh copy of the server part; running sums."""
        c, s = self.copies[0], self.server_copy
        client_total = server_total = None
        for _, x, y in batches:
            c.load_state_dict(self.client.state_dict())
            s.load_state_dict(self.server.state_dict())
            co, so = adam(c), adam(s)
            z = c(x)
            grad = self._server_step(s, so, z, y)
            co.zero_grad(set_to_none=True)
            z.backward(grad)
            co.step()
            client_total, server_total = accumulate(client_total, c), accumulate(server_total, s)
        load_mean(self.client, client_total, len(batches))
        load_mean(self.server, server_total, len(batches))

    def sfl_v2(self, rnd, batches):
        opts = {}
        for k, _, _ in batches:
            self.copies[k].load_state_dict(self.client.state_dict())
            opts[k] = adam(self.copies[k])
        for k, x, y in batches:
            z = self.copies[k](x)
            grad = self._server_step(self.server, self.server_opt, z, y)
            opts[k].zero_grad(set_to_none=True)
            z.backward(grad)
            opts[k].step()
        average_into(self.client, [self.copies[k] for k, _, _ in batches])

    def cycle_sfl(self, rnd, batches):
        opts, smashed = {}, []
        for k, x, _ in batches:
            self.copies[k].load_state_dict(self.client.state_dict())
            opts[k] = adam(self.copies[k])
            smashed.append(self.copies[k](x))
        features = torch.cat([z.detach() for z in smashed])
        labels = torch.cat([y for _, _, y in batches])
        order = torch.as_tensor(np.random.default_rng([0, rnd, 4]).permutation(len(labels)))
        for idx in order.split(32):  # the server's epoch over the pooled features
            loss = F.cross_entropy(self.server(features[idx]), labels[idx])
            self.server_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.server_opt.step()
        for (k, _, y), z in zip(batches, smashed):  # frozen updated server: cut gradients
            grad = cut_grad(self.server, z, y)
            opts[k].zero_grad(set_to_none=True)
            z.backward(grad)
            opts[k].step()
        average_into(self.client, [self.copies[k] for k, _, _ in batches])

    def fsl_sage(self, rnd, batches):
        for k, x, y in batches:
            c = self.copies[k]
            c.load_state_dict(self.client.state_dict())
            opt = adam(c)
            z = c(x)
            estimate = cut_grad(self.aux[k], z, y)
            opt.zero_grad(set_to_none=True)
            z.backward(estimate)
            opt.step()
            z = z.detach()
            loss = F.cross_entropy(self.server(z), y)  # step 0 is a multiple of q: the server steps
            self.server_opt.zero_grad(set_to_none=True)
            loss.backward()
            self.server_opt.step()
            self.buffers[k] = (self.buffers[k] + [(z, y)])[-(1000 // 32) :]
        average_into(self.client, [self.copies[k] for k, _, _ in batches])
        if rnd % 10 == 0:  # alignment of every client's aux model on its buffer
            for k, _, _ in batches:
                z = torch.cat([b[0] for b in self.buffers[k]])
                y = torch.cat([b[1] for b in self.buffers[k]])
                target = torch.cat(
                    [cut_grad(self.server, zi, yi) * len(yi) for zi, yi in zip(z.split(100), y.split(100))]
                )
                opt = torch.optim.Adam(self.aux[k].parameters(), lr=1e-3, foreach=True)
                for epoch in range(5):
                    for idx in torch.as_tensor(np.random.default_rng([0, rnd, 5, k, epoch]).permutation(len(y))).split(
                        100
                    ):
                        est = cut_grad(self.aux[k], z[idx], y[idx], create_graph=True) * len(idx)
                        loss = F.mse_loss(est, target[idx], reduction="sum") / len(idx)
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()

    def _server_step(self, server, opt, z, y):
        z = z.detach().requires_grad_()
        loss = F.cross_entropy(server(z), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return z.grad


def plain_run(algorithm: str, x: torch.Tensor, y: torch.Tensor, plan, test_x, test_y) -> tuple[float, float]:
    """(round-loop seconds, end-to-end seconds) of the plain loop."""
    started = time.perf_counter()
    loop = PlainLoop(algorithm)
    loop_started = time.perf_counter()
    for rnd, batches in enumerate(plan):
        loop.round(rnd, [(k, x[idx], y[idx]) for k, idx in batches])
    loop_seconds = time.perf_counter() - loop_started
    with torch.no_grad():
        model = nn.Sequential(loop.client, loop.server).eval()
        logits = torch.cat([model(test_x[i : i + 1024]) for i in range(0, len(test_x), 1024)])
        float(F.cross_entropy(logits, test_y))
    return loop_seconds, time.perf_counter() - started


def splitlab_run(config: dict) -> tuple[float, float]:
    from splitlab.engine import run

    started = time.perf_counter()
    summary = run(config, progress=False)
    return summary["wall_seconds"], time.perf_counter() - started


def timed_run(side: str, algorithm: str, args: argparse.Namespace) -> tuple[float, float]:
    """One side's (round-loop, end-to-end) seconds; the dataset parse and the schedule come first,
    untimed, alike for both sides."""
    from splitlab.data import load_dataset

    full = load_dataset("fashion_mnist")
    with tempfile.TemporaryDirectory() as tmp:
        config = workload(algorithm, args, str(Path(tmp) / algorithm))
        x, y, plan = schedule(config)
        if side == "splitlab":
            return splitlab_run(config)
        return plain_run(algorithm, x, y, plan, full.inputs(full.test_x), full.test_y)


def throughput(args: argparse.Namespace) -> None:
    print(
        f"Fashion-MNIST ({args.samples} samples), 20 clients x 1 batch of 32 per round, cnn cut 2, Adam, "
        f"{args.rounds} rounds, torch threads {args.threads}, median of {args.repeats} runs per side, "
        f"each in a fresh process, alternating; ratio = plain-torch seconds / splitlab seconds (1.0 = as fast)"
    )
    for algorithm in args.algorithms:
        runs: dict[str, list[tuple[float, float]]] = {"splitlab": [], "plain": []}
        for repeat in range(args.repeats):
            for side in sorted(runs, reverse=repeat % 2 == 0):  # who goes first alternates
                result = in_child(args, job="throughput", side=side, algorithm=algorithm)
                runs[side].append((result["loop"], result["whole"]))
        ours, plain = runs["splitlab"], runs["plain"]
        loop = statistics.median(p[0] for p in plain) / statistics.median(o[0] for o in ours)
        whole = statistics.median(p[1] for p in plain) / statistics.median(o[1] for o in ours)
        print(
            f"  {algorithm:9s} round loop {loop:.3f}  end to end {whole:.3f}   "
            f"(splitlab {statistics.median(o[1] for o in ours):.2f} s, "
            f"plain {statistics.median(p[1] for p in plain):.2f} s per run)",
            flush=True,
        )


def in_child(args: argparse.Namespace, **job: str) -> dict:
    """Runs `job` in a fresh process, as a `splitlab` command runs: the heap one run leaves behind
    (kept for reuse, see splitlab.process_settings) must not speed up or slow down the next."""
    spec = {**vars(args), **job}
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def child(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    # torch's first optimizer imports torch._dynamo (1.5 s): both sides pay it here, before timing,
    # so that the round loop does not charge it to splitlab, whose optimizers are made in round 1
    importlib.import_module("torch._dynamo")
    if spec["malloc"] == "reuse":
        from splitlab.process_settings import reuse_freed_memory

        reuse_freed_memory()
    if spec["job"] == "rss":
        result = {"peak_rss_mib": rss_child(spec["side"], spec["rss_samples"])}
    else:
        loop, whole = timed_run(spec["side"], spec["algorithm"], argparse.Namespace(**spec))
        result = {"loop": loop, "whole": whole}
    print(json.dumps(result))


# --- peak RSS -------------------------------------------------------------------------------------


def rss_child(kind: str, samples: int) -> float:
    """Peak RSS (MiB) of one SFL-V2 round of `kind` (splitlab or plain) in this fresh process."""
    from splitlab.process_settings import peak_memory_mib

    if kind == "splitlab":
        from splitlab.engine import run

        with tempfile.TemporaryDirectory() as tmp:
            run(
                dict(
                    algorithm="sfl_v2",
                    dataset="fashion_mnist",
                    model="cnn",
                    cut=2,
                    clients=8,
                    batch_size=32,
                    train_subset=samples,
                    optimizer="adam",
                    device="cpu",
                    seed=0,
                    rounds=1,
                    out=tmp,
                    overwrite=True,
                ),
                progress=False,
            )
    else:  # the plain loop: its own reader, the chosen samples as float32, one SFL-V2 round
        from splitlab.models import build_model, split  # model definitions only (torch modules)

        def read(name: str, header: int) -> np.ndarray:
            return np.frombuffer(gzip.decompress((FASHION / name).read_bytes()), np.uint8, offset=header)

        rng = np.random.default_rng(0)
        images = read("train-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)
        chosen = np.sort(rng.choice(len(images), samples, replace=False))
        x = torch.from_numpy(images[chosen].astype(np.float32)).div_(255).sub_(MEAN).div_(STD)
        y = torch.from_numpy(read("train-labels-idx1-ubyte.gz", 8)[chosen].astype(np.int64))
        del images
        test = read("t10k-images-idx3-ubyte.gz", 16).reshape(-1, 1, 28, 28)
        test_x = torch.from_numpy(test.astype(np.float32)).div_(255).sub_(MEAN).div_(STD)
        torch.from_numpy(read("t10k-labels-idx1-ubyte.gz", 8).astype(np.int64))
        client, server = split(build_model("cnn", (1, 28, 28), 10, seed=0), 2)
        copies = [copy.deepcopy(client) for _ in range(8)]
        opts = [adam(c) for c in copies]
        server_opt = adam(server)
        parts = np.array_split(rng.permutation(samples), 8)
        for step in range(max(len(p) for p in parts) // 32 + 1):
            for k, part in enumerate(parts):
                idx = torch.as_tensor(part[step * 32 : (step + 1) * 32])
                if len(idx) == 0:
                    continue
                z = copies[k](x[idx])
                zd = z.detach().requires_grad_()
                loss = F.cross_entropy(server(zd), y[idx])
                server_opt.zero_grad(set_to_none=True)
                loss.backward()
                server_opt.step()
                opts[k].zero_grad(set_to_none=True)
                z.backward(zd.grad)
                opts[k].step()
        average_into(client, copies)
        with torch.no_grad():
            model = nn.Sequential(client, server).eval()
            torch.cat([model(test_x[i : i + 1024]) for i in range(0, len(test_x), 1024)]).argmax(1)
    return peak_memory_mib()


def peak_rss(args: argparse.Namespace) -> None:
    runs: dict[str, list[float]] = {"splitlab": [], "plain": []}
    for _ in range(args.repeats):
        for kind in runs:
            runs[kind].append(in_child(args, job="rss", side=kind)["peak_rss_mib"])
    ours, plain = (statistics.median(v) for v in runs.values())
    print(
        f"peak RSS, sfl_v2 one round over {args.rss_samples} Fashion-MNIST samples, 8 clients, fresh processes: "
        f"splitlab {ours:.0f} MiB, plain torch {plain:.0f} MiB, ratio {ours / plain:.3f} (target <= 1.2)"
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=12000, help="train_subset of the throughput runs")
    parser.add_argument("--rss-samples", type=int, default=12000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, fixed for both sides")
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument(
        "--malloc",
        choices=("reuse", "default"),
        default="reuse",
        help="reuse: glibc keeps freed memory, as in every process the splitlab command starts "
        "(splitlab.process_settings; both sides alike); default: glibc's own thresholds",
    )
    parser.add_argument("--rss", action="store_true", help="also measure peak RSS")
    parser.add_argument("--rss-only", action="store_true")
    args = parser.parse_args()
    if args.rss or args.rss_only:
        peak_rss(args)
    if not args.rss_only:
        throughput(args)


if __name__ == "__main__":
    main()
