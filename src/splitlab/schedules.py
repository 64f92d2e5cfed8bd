"""Learning-rate schedules: by round (`lr_schedule=`) and by optimizer step (`warmup_steps=`,
`warmup_ratio=`, `lr_decay=`), as factors of `lr`, multiplied together.

    step:<every>:<gamma>   lr * gamma ** (round // every)
    cosine                 lr * (1 + cos(pi * round / rounds)) / 2
    warmup:<rounds>        lr * min(1, (round + 1) / rounds), a linear warm-up
    e.g. warmup:5+cosine

`round` counts from 0. Each role applies the factor of the round it is in to the optimizers it
holds (splitlab.roles.Role.optimizer), so the schedule is the same whatever the transport. It
scales every training optimizer (client, server and auxiliary parts; SGLR's and CycleSL's
`server_lr` too), not FSL-SAGE's alignment, which has its own `align_lr`.

By step, as transformers' Trainer schedules (`get_linear_schedule_with_warmup`, `..._cosine_...`):
step s (counted from 0, the optimizer steps taken before) of a schedule of `total` steps with
`warmup` steps has the factor s / warmup while s < warmup, then decays from 1 to 0 over the rest,
linearly or along a half cosine (none: stays 1). Each role counts its own steps, slot by slot: in
round r of `rounds`, a slot's step j of the n it takes in a round is step r * n + j of rounds * n
(a client's n: its batches of a round; the training server's: the steps the algorithm has it take,
told by the orchestrator beside it; a server copy of a client's part, that client's). Nothing is
sent for it, and a round restarts its count, so a resumed run and every transport (clients
training at once on Ray too) give the same rates.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Factor = Callable[[int, int], float]  # (round, rounds) -> factor of lr

EXAMPLE = "e.g. step:10:0.5, cosine, warmup:5 or warmup:5+cosine"


def parse_lr_schedule(value: str) -> list[Factor]:
    """The factors of `value` ("none": no factor); ValueError naming what is allowed."""
    if value == "none":
        return []
    return [_factor(part) for part in value.split("+")]


def _factor(part: str) -> Factor:
    kind, *args = part.split(":")
    try:
        numbers = [float(arg) for arg in args]
    except ValueError:
        numbers = []
    if kind == "cosine" and not args:
        return lambda rnd, rounds: (1 + math.cos(math.pi * rnd / rounds)) / 2
    if kind == "step" and len(numbers) == 2 and numbers[0] >= 1 and numbers[0] == int(numbers[0]) and numbers[1] > 0:
        every, gamma = int(numbers[0]), numbers[1]
        return lambda rnd, rounds: gamma ** (rnd // every)
    if kind == "warmup" and len(numbers) == 1 and numbers[0] >= 1 and numbers[0] == int(numbers[0]):
        length = int(numbers[0])
        return lambda rnd, rounds: min(1.0, (rnd + 1) / length)
    raise ValueError(
        f"{part!r} is not a schedule; expected none, step:<every rounds>:<gamma>, cosine or "
        f"warmup:<rounds>, joined by + ({EXAMPLE})"
    )


def lr_factor(factors: list[Factor], rnd: int, rounds: int) -> float:
    """The factor of lr in round `rnd` (from 0) of `rounds`."""
    return math.prod(factor(rnd, rounds) for factor in factors)


def warmup_length(warmup_steps: int, warmup_ratio: float, total: int) -> int:
    """The warm-up's steps: `warmup_steps`, or `warmup_ratio` of `total`, rounded up (as the Trainer's)."""
    return warmup_steps or math.ceil(warmup_ratio * total)


def step_factor(step: int, total: int, warmup: int, decay: str) -> float:
    """The factor of lr at optimizer step `step` (from 0) of `total`: a linear warm-up over
    `warmup` steps, then `decay` (none | linear | cosine) to 0 at `total`."""
    if step < warmup:
        return step / warmup
    if decay == "none":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if decay == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, (1 + math.cos(math.pi * min(1.0, progress))) / 2)
