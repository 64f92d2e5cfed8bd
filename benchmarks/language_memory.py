"""Peak memory of SFL-V1 + LoRA on model=gpt with K=10 vs K=100 clients (issue 23).

SFL-V1 keeps, per client, a client part and a server-side copy of the server part, each with an
Adam state. Under LoRA every copy shares one frozen base (`models/trainable.py`), so K clients
should cost the base once plus K adapter sets: the growth from K=10 to K=100 should be about 90
adapter sets (weights + Adam's two moments), not 90 models. The adapters' size is computed here
by hand (GPT-2's c_attn, D -> 3D, is the default target: R (D + 3D) parameters per block) and
checked against the model's trainable parameters.

Each K runs one round (every client one batch) in a fresh process: on CPU its peak resident set
size (VmHWM), on CUDA `torch.cuda.max_memory_allocated` after building the run. LoRA fine-tunes a
pretrained model (`init=`): a one-step centralized run stands in for the pretraining.

    .venv/bin/python benchmarks/language_memory.py [--device cpu|cuda] [--width 256] [--layers 4] [--rank 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

MIB = 2**20


def config(args: argparse.Namespace, clients: int) -> dict:
    return dict(
        algorithm="sfl_v1", dataset="shakespeare_lm", model="gpt", layers=args.layers, width=args.width,
        heads=4, context=args.seq_len, seq_len=args.seq_len, lora=f"{args.rank}:{2 * args.rank}", cut=1,
        clients=clients, train_subset=clients * args.batch, batch_size=args.batch, local_steps=1,
        optimizer="adam", lr=1e-3, device=args.device, seed=0, init=args.init,
    )  # fmt: skip


def pretrain(args: argparse.Namespace, out: str) -> None:
    """The model the runs fine-tune: the same GPT after one centralized step."""
    from splitlab.engine import run

    settings = {k: v for k, v in config(args, 1).items() if k not in ("lora", "cut", "init")}
    run(dict(settings, algorithm="centralized", rounds=1, out=out), progress=False)


def adapter_parameters(args: argparse.Namespace) -> int:
    """By hand: c_attn's adapter in every block, A (R x D) and B (3D x R); client and server parts together."""
    return args.layers * args.rank * (args.width + 3 * args.width)


def child(args: argparse.Namespace, clients: int) -> None:
    import torch

    from splitlab.engine import build
    from splitlab.process_settings import peak_memory_mib

    torch.set_num_threads(1)
    experiment = build(config(args, clients))
    client, server = experiment.blueprint.new_split()
    trainable = sum(p.numel() for part in (client, server) for p in part.parameters() if p.requires_grad)
    frozen = sum(p.numel() for part in (client, server) for p in part.parameters() if not p.requires_grad)
    if args.device == "cuda":
        torch.cuda.synchronize()
        built = torch.cuda.memory_allocated() / MIB
        torch.cuda.reset_peak_memory_stats()
    experiment.algorithm.run_round(0, experiment.clients)
    if args.device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / MIB
    else:
        built, peak = 0.0, peak_memory_mib()
    print(json.dumps({"peak_mib": peak, "built_mib": built, "trainable": trainable, "frozen": frozen}))


def measure(args: argparse.Namespace, clients: int) -> dict:
    keys = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("clients", "child")]
    out = subprocess.run(
        [sys.executable, __file__, f"--child={clients}", *keys], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--clients", default="10,100", help="the two client counts compared")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args, args.child)
        return
    small_k, large_k = (int(k) for k in args.clients.split(","))
    with tempfile.TemporaryDirectory() as folder:
        args.init = f"{folder}/pretrained"
        pretrain(args, args.init)
        small, large = measure(args, small_k), measure(args, large_k)
    by_hand = adapter_parameters(args)
    assert small["trainable"] == by_hand, (small["trainable"], by_hand)  # the formula is the model's
    set_mib = 3 * 4 * by_hand / MIB  # float32 weights + Adam's two moments
    what = "peak RSS of a fresh process" if args.device == "cpu" else "torch.cuda.max_memory_allocated"
    print(
        f"SFL-V1 + LoRA r={args.rank}, model=gpt {args.layers} blocks x width {args.width}, cut 1, "
        f"one round of one batch of {args.batch} x {args.seq_len} tokens per client, {args.device} ({what})"
    )
    print(f"frozen base: {small['frozen']:,} parameters = {4 * small['frozen'] / MIB:.2f} MiB (held once)")
    print(
        f"one adapter set by hand: {args.layers} x {args.rank} x (D + 3D) = {by_hand:,} parameters = "
        f"{4 * by_hand / 1024:.1f} KiB, {set_mib * 1024:.1f} KiB with Adam's moments"
    )
    for k, row in ((small_k, small), (large_k, large)):
        extra = f" (after building: {row['built_mib']:.1f} MiB)" if args.device == "cuda" else ""
        print(f"K={k}: peak {row['peak_mib']:.1f} MiB{extra}")
    grown, expected = large["peak_mib"] - small["peak_mib"], (large_k - small_k) * set_mib
    base_copies = (large_k - small_k) * 4 * small["frozen"] / MIB  # a client part + a server part each
    print(
        f"growth K={small_k} -> {large_k}: {grown:.1f} MiB; {large_k - small_k} adapter sets with Adam: "
        f"{expected:.1f} MiB; had every client and server copy its own base: {base_copies:.0f} MiB more"
    )


if __name__ == "__main__":
    main()
