"""Hooks into the round loop: what happens around training, apart from training itself.

The engine's loop trains a round, evaluates it when due and checkpoints; everything else is a
`Callback`: the progress bar, metrics.jsonl, the trackers (splitlab.loggers), the recorder of
what the server saw, the communication budget. A callback of your own is passed to
`splitlab.engine.run(config, callbacks=[...])`. Callbacks observe; none of them draws a random
number or touches a role, so results are the same with or without them.

`state` is the loop's state, as checkpointed: `round` (rounds finished), `metrics` (the rows so
far), `wall_seconds`, `stopped_by`, `steps` and `samples` (training steps and samples so far),
`step_rows` (log_every's rows so far).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from splitlab.io import write_jsonl
from splitlab.logs import Lines
from splitlab.units import GIB, format_bytes

State = dict[str, Any]
log = logging.getLogger(__name__)


class Callback:
    """The hooks, each a no-op here; override those you need."""

    def on_run_start(self, state: State) -> None:
        """Before the first round of this process (a resumed run starts at `state["round"]`)."""

    def on_round_start(self, state: State, batches: int | None) -> None:
        """Before a round's training; `batches`: how many client mini-batches it draws (None where
        clients draw none, as vertical parties)."""

    def on_round_trained(self, state: State) -> str | None:
        """After a round's training, before its evaluation: a reason to stop the run here (it is
        then evaluated and summarized), or None to go on."""
        return None

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        """After a round; `row` is its metrics row when it was evaluated, else None."""

    def on_steps(self, state: State, row: dict[str, Any]) -> None:
        """Every `log_every` training steps (within a round): `row` of the steps since the last
        (`StepLog`: step, round, loss, lr, grad_norm, tokens_per_second or samples_per_second)."""

    def on_run_end(self, state: State) -> None:
        """After the last round, or when the loop stops on an error (release what you hold)."""


class MetricsFile(Callback):
    """metrics.jsonl: every evaluated round's row, the whole file rewritten atomically."""

    def __init__(self, out: Path) -> None:
        self.path = out / "metrics.jsonl"

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        if row is not None:
            write_jsonl(self.path, state["metrics"])


class StepLog(Callback):
    """log_every=N: every N training steps (each a client batch trained on), a row of their mean
    loss, the learning rate at the last one (`lr_at(round, step in the round)`, the run's clock:
    the training server's, and with one client every role's), the gradient norm the server gave
    for it (the server part's; clip_scope=global: the whole model's) and the `unit`s (tokens, or
    samples) per second since the last row, `per_step` in a full batch; to steps.jsonl (rewritten
    from the loop's state at each round's end) and to every callback's `on_steps`."""

    def __init__(
        self,
        out: Path,
        every: int,
        lr_at: Callable[[int, int], float],
        unit: str,
        per_step: int,
        listeners: Sequence[Callback],
    ) -> None:
        self.path, self.every, self.lr_at = out / "steps.jsonl", every, lr_at
        self.rate, self.per_step, self.listeners = f"{unit}_per_second", per_step, listeners
        self.state: State = {}
        self._losses: list[torch.Tensor] = []
        self._in_round = 0
        self._since = time.perf_counter()

    def on_run_start(self, state: State) -> None:
        """A resumed run takes up the losses of the steps since the last row, as checkpointed."""
        self._losses = [torch.tensor(value) for value in state.get("pending_losses", [])]
        self._since = time.perf_counter()

    def on_round_start(self, state: State, batches: int | None) -> None:
        self.state, self._in_round = state, 0

    def step(self, steps: int, loss: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Training step number `steps` (from 1) was taken, with `loss` (and `grad_norm`)."""
        self._in_round += 1
        self._losses.append(loss.detach())
        if steps % self.every:
            return
        now = time.perf_counter()
        row = {
            "step": steps,
            "round": self.state["round"] + 1,
            "loss": float(torch.stack(self._losses).float().mean()),
            "lr": self.lr_at(self.state["round"], self._in_round - 1),
            "grad_norm": None if grad_norm is None else float(grad_norm),
            self.rate: len(self._losses) * self.per_step / max(now - self._since, 1e-9),
        }
        self._losses, self._since = [], now
        self.state.setdefault("step_rows", []).append(row)
        for listener in self.listeners:
            listener.on_steps(self.state, row)

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        state["pending_losses"] = [float(loss) for loss in self._losses]
        write_jsonl(self.path, state.get("step_rows", []))


class CommBudget(Callback):
    """Stops the run once `budget_gib` has been communicated (comm_budget_gib)."""

    def __init__(self, ledger: Any, budget_gib: float) -> None:
        self.ledger, self.budget_bytes = ledger, budget_gib * GIB

    def on_round_trained(self, state: State) -> str | None:
        return "comm_budget" if self.ledger.total_bytes >= self.budget_bytes else None


class RecorderFlush(Callback):
    """Writes what the recorder saw at the cut in the round just trained (record=N)."""

    def __init__(self, recorder: Any, out: Path) -> None:
        self.recorder, self.out = recorder, out

    def on_round_trained(self, state: State) -> str | None:
        self.recorder.flush(self.out, state["round"])  # numbered from 1, as metrics rows
        return None


class ProgressBar(Callback):
    """A progress bar on a terminal; one line per evaluated round elsewhere (logs, CI, nohup).
    Within a round, the client mini-batches drawn so far: a second bar on a terminal, elsewhere a
    line every few seconds (`splitlab.logs.Lines`). Only clients in this process are counted
    (`Blueprint.on_batch`): with backend=ray or over a network they draw their batches elsewhere."""

    def __init__(self, title: str, rounds: int, ledger: Any, blueprint: Any = None) -> None:
        self.title, self.rounds, self.ledger, self.blueprint = title, rounds, ledger, blueprint
        self.lines = not sys.stderr.isatty()
        self.round_lines = Lines("", 0, "")
        self.bar = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[extra]}"),
            TimeElapsedColumn(),
            disable=self.lines,
            transient=False,
        )

    def on_run_start(self, state: State) -> None:
        self.bar.start()
        self.task = self.bar.add_task(self.title, total=self.rounds, **self._fields(state))
        self.batches = self.bar.add_task("batches", total=None, visible=False, extra="")
        if self.blueprint is not None:
            self.blueprint.on_batch = self._batch

    def on_round_start(self, state: State, batches: int | None) -> None:
        title = f"round {state['round'] + 1}/{self.rounds}"
        self.round_lines = Lines(title, batches or 0, "client batches")
        self.bar.reset(self.batches, total=batches, description=title, visible=False)

    def _batch(self) -> None:
        """Shown from the first batch counted: none is where clients run elsewhere."""
        if self.lines:
            self.round_lines.advance()
        else:
            self.bar.update(self.batches, advance=1, visible=True)

    def on_round_end(self, state: State, row: dict[str, Any] | None) -> None:
        if self.lines and row is not None:
            log.info(round_line(row, self.rounds))
        self.bar.update(self.batches, visible=False)
        self.bar.update(self.task, **self._fields(state))

    def on_run_end(self, state: State) -> None:
        if self.blueprint is not None:
            self.blueprint.on_batch = None
        self.bar.stop()

    def _fields(self, state: State) -> dict[str, Any]:
        rows = state["metrics"]
        accuracy = f"{100 * rows[-1]['test_accuracy']:.2f}%" if rows else "-"
        return {"completed": state["round"], "extra": f"acc {accuracy}  {format_bytes(self.ledger.total_bytes)}"}


def round_line(row: dict, rounds: int) -> str:
    """One plain line per evaluated round, for output that is not a terminal."""
    return (
        f"round {row['round']}/{rounds}  acc {100 * row['test_accuracy']:.2f}%  "
        f"loss {row['test_loss']:.4f}  {format_bytes(row['comm_bytes'])}  {row['wall_seconds']:.1f} s"
    )
