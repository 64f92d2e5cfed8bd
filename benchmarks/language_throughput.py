"""Tokens per second of SFL-V2 on model=gpt + shakespeare_lm against a plain-torch loop (issues 23, 33).

Workload: `model=gpt` at its defaults (4 blocks, width 128, 4 heads), cut 2, sequences of 64
characters, 8 clients, one batch of 16 sequences per client per round, Adam. The plain loop is
SFL-V2 written with bare modules (`benchmarks/throughput.py`'s), over the very batches splitlab
draws (read from the built experiment before timing); both sides' round loops are timed
(splitlab's summary `wall_seconds`), alternating who goes first, and the medians compared.
`--lora R:ALPHA` trains LoRA adapters on the frozen model on both sides (the plain loop copies and
averages only the adapters); `--precision bf16` runs both sides' forward passes and losses under
torch's autocast, the hidden states and cut gradients crossing as bfloat16, as splitlab does;
`--precision fp16` in float16, each side with its own `torch.amp.GradScaler` and the server's
scaled cut gradient rescaled into the client's scale, as splitlab's loss scales do.

    .venv/bin/python benchmarks/language_throughput.py [--rounds 20] [--repeats 3] [--threads 1] [--device cuda]
        [--lora 8:16] [--precision bf16|fp16]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from throughput import schedule  # noqa: E402

CLIENTS, BATCH, SEQ_LEN = 8, 16, 64


def workload(rounds: int, out: str, device: str = "cpu", lora: str | None = None, precision: str = "fp32") -> dict:
    return dict(
        algorithm="sfl_v2", dataset="shakespeare_lm", model="gpt", cut=2, seq_len=SEQ_LEN, clients=CLIENTS,
        batch_size=BATCH, local_steps=1, optimizer="adam", lr=1e-3, device=device, seed=0, rounds=rounds,
        eval_every=rounds, test_subset=64, out=out, overwrite=True, lora=lora, precision=precision,
    )  # fmt: skip


def trainable(module: nn.Module) -> dict[str, torch.Tensor]:
    """What trains (with LoRA: the adapters), by name: what the plain loop copies and averages."""
    return {name: p for name, p in module.named_parameters() if p.requires_grad}


def adam(module: nn.Module) -> torch.optim.Adam:
    return torch.optim.Adam(trainable(module).values(), lr=1e-3, foreach=True)


def plain_seconds(config: dict) -> float:
    """SFL-V2 with bare modules: client copies loaded from the global client part, one server."""
    from splitlab.config import parse_lora
    from splitlab.models import build_model, split

    device = torch.device(config["device"])
    x, y, plan = schedule(config)
    x, y = x.to(device), y.to(device)
    lora = parse_lora(config["lora"]) if config["lora"] else None
    client, server = (part.to(device) for part in split(build_model("gpt", (SEQ_LEN,), 80, seed=0, lora=lora), 2))
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config["precision"])
    scaling = config["precision"] == "fp16"  # disabled scalers pass the loss and the steps through as they are
    server_opt, copies = adam(server), [copy.deepcopy(client) for _ in range(CLIENTS)]
    server_scaler = torch.amp.GradScaler(device.type, enabled=scaling)
    client_scalers = [torch.amp.GradScaler(device.type, enabled=scaling) for _ in range(CLIENTS)]
    started = time.perf_counter()
    for batches in plan:
        opts = {}
        for k, _ in batches:
            copies[k].load_state_dict(trainable(client), strict=False)
            opts[k] = adam(copies[k])
        for k, idx in batches:
            with torch.autocast(device.type, dtype=half or torch.bfloat16, enabled=half is not None):
                z = copies[k](x[idx])
                wire = z.to(half) if half else z
                received = wire.detach().requires_grad_()
                loss = F.cross_entropy(server(received).flatten(0, 1), y[idx].flatten())
            server_opt.zero_grad(set_to_none=True)
            server_scale = server_scaler.get_scale() if scaling else 1.0
            server_scaler.scale(loss).backward()
            server_scaler.step(server_opt)
            server_scaler.update()
            grad = received.grad
            if scaling:  # the server's scaled gradient, in the client's scale
                grad = client_scalers[k].scale(grad.float() / server_scale).to(half)
            opts[k].zero_grad(set_to_none=True)
            wire.backward(grad)
            client_scalers[k].step(opts[k])
            client_scalers[k].update()
        states = [trainable(copies[k]) for k, _ in batches]
        with torch.no_grad():
            for name, weight in trainable(client).items():
                weight.copy_(torch.stack([state[name] for state in states]).mean(0))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


def splitlab_seconds(config: dict) -> float:
    from splitlab.engine import run

    return run(config, progress=False)["wall_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--lora", default=None, help="R:ALPHA: train LoRA adapters on both sides")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.rounds * CLIENTS * BATCH * SEQ_LEN
    times: dict[str, list[float]] = {"splitlab": [], "plain": []}
    with tempfile.TemporaryDirectory() as tmp:
        config = workload(args.rounds, str(Path(tmp) / "run"), args.device, args.lora, args.precision)
        for repeat in range(args.repeats):
            for side in sorted(times, reverse=repeat % 2 == 0):
                times[side].append(splitlab_seconds(config) if side == "splitlab" else plain_seconds(config))
    ours, plain = statistics.median(times["splitlab"]), statistics.median(times["plain"])
    print(
        f"SFL-V2, model=gpt (4 x 128) cut 2, lora={args.lora}, {args.precision}, "
        f"{CLIENTS} clients x {BATCH} x {SEQ_LEN} tokens per round, "
        f"{args.rounds} rounds, {args.device}, {args.threads} thread(s), median of {args.repeats}: "
        f"splitlab {tokens / ours:,.0f} tokens/s, plain torch {tokens / plain:,.0f} tokens/s, "
        f"ratio {plain / ours:.3f} (1.0 = as fast)"
    )


if __name__ == "__main__":
    main()
