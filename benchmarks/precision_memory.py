"""Peak memory of one SFL-V2 + LoRA step on a GPT-2-medium-shaped model: fp32 against bf16 and
gradient checkpointing (issue 33).

The model is `model=gpt` with GPT-2 medium's body (24 blocks of width 1024, 16 heads; random
weights, the plays' 80 characters as vocabulary), LoRA on c_attn, cut after block 1, one client,
one step of `--batch` x `--seq-len` tokens (Adam). Each setting runs in a fresh process: on the
CPU the peak resident set size (VmHWM) against the resident size once built, so the difference is
what the step itself took (activations, gradients, Adam's state of the adapters; the models are
built first, and the peak is reset to the resident size there); on CUDA
`torch.cuda.max_memory_allocated` during the step against what was allocated before it.

    .venv/bin/python benchmarks/precision_memory.py [--device cpu|cuda] [--batch 4] [--seq-len 256]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20
SETTINGS = {
    "fp32": {},
    "fp32 + checkpointing": {"gradient_checkpointing": True},
    "bf16": {"precision": "bf16"},
    "bf16 + checkpointing": {"precision": "bf16", "gradient_checkpointing": True},
}


def config(args: argparse.Namespace, setting: str) -> dict:
    return dict(
        algorithm="sfl_v2", dataset="shakespeare_lm", model="gpt", layers=24, width=1024, heads=16,
        context=args.seq_len, seq_len=args.seq_len, lora="8:16", cut=1, clients=1, train_subset=args.batch,
        batch_size=args.batch, local_steps=1, optimizer="adam", lr=1e-3, device=args.device, seed=0,
        **SETTINGS[setting],
    )  # fmt: skip


def resident_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(args: argparse.Namespace, setting: str) -> None:
    import torch

    from splitlab.engine import build
    from splitlab.process_settings import peak_memory_mib

    torch.set_num_threads(args.threads)
    experiment = build(config(args, setting))
    experiment.roles.sync.model("client_model")  # the models a round would build first
    experiment.roles.server.model("server_model")
    if args.device == "cuda":
        torch.cuda.synchronize()
        built = torch.cuda.memory_allocated() / MIB
        torch.cuda.reset_peak_memory_stats()
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from the resident size
        built = resident_mib()
    started = time.perf_counter()
    experiment.algorithm.run_round(0, experiment.clients)
    loss = experiment.algorithm.pop_train_loss()
    if args.device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / MIB
    else:
        peak = peak_memory_mib()
    seconds = time.perf_counter() - started
    print(json.dumps({"built_mib": built, "peak_mib": peak, "seconds": seconds, "loss": loss}))


def measure(args: argparse.Namespace, setting: str) -> dict:
    keys = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "child" and v is not None]
    out = subprocess.run(
        [sys.executable, __file__, f"--child={setting}", *keys], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated, of: " + ", ".join(SETTINGS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args, args.child)
        return
    what = "peak RSS - RSS once built" if args.device == "cpu" else "max_memory_allocated - allocated before"
    print(
        f"SFL-V2 + LoRA 8:16, model=gpt 24 blocks x 1024 (GPT-2 medium's body), cut 1, one step of "
        f"{args.batch} x {args.seq_len} tokens, {args.device}, {args.threads} thread(s); the step's memory: {what}"
    )
    for setting in args.settings.split(","):
        row = measure(args, setting)
        print(
            f"{setting:>22}: step {row['peak_mib'] - row['built_mib']:8.1f} MiB (built {row['built_mib']:.1f}, "
            f"peak {row['peak_mib']:.1f}); {row['seconds']:.1f} s, loss {row['loss']:.4f}"
        )


if __name__ == "__main__":
    main()
