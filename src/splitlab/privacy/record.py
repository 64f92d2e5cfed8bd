"""`record=N`: what the training server saw at the cut, kept for attacks after the run.

In each round, the first N samples whose smashed data reaches the server are recorded as the
server decoded them (`smashed`), with their labels and, where the algorithm sends one, the cut
gradient the server sent back (`cut_grad`, as the client decoded it); in a U-shaped split, where
the labels stay with the client (recorded for scoring only), also the gradient at the second cut
the client sent up (`tail_grad`), what a curious server infers labels from. The inputs the
smashed data came from (`inputs`) are recorded too, by the experimenter and for scoring only:
the server never sees them; so are the client (`clients`) and the batch of the round (`batches`,
numbered from 0 in the order they reached the server; -1 for the samples of a batch `record=N`
cut short) each sample came in, for attacks scored per batch as the label-leak paper scores
them. With them, the client part that produced them (`weights.<client>.<name>`: its shared state,
the trainable tensors of a LoRA model), as it was at the client's first recorded release of the
round, before the round's first update: the weights the round started with, which the sync
server handed out. An attack on the record uses those, not the run's final weights, which the
record was never made with. One safetensors file per round, `record/round_<r>.safetensors` (a resumed run rewrites the
rounds it replays). Recording happens where the client and the server live in one process. A
vertical run records per party (`PartyRecorder`: `<name>@<party>`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from splitlab.io import save_safetensors

RECORD_DIR = "record"
WEIGHTS = "weights"  # a round file's client weights: weights.<client>.<state name>


def round_file(run_dir: Path, rnd: int) -> Path:
    return Path(run_dir) / RECORD_DIR / f"round_{rnd:04d}.safetensors"


class Recorder:
    """Collects one round's cut-layer traffic (up to `limit` samples); `flush` writes it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._batches: list[dict[str, torch.Tensor]] = []
        self._awaiting: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # the latest batch per key
        self._count = 0
        self._weights: dict[int, dict[str, torch.Tensor]] = {}  # by client, this round

    def sent(
        self,
        client_id: int,
        key: int,
        inputs: torch.Tensor,
        smashed: torch.Tensor,
        labels: torch.Tensor,
        weights: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        """A batch of smashed data as the server decodes it, under (client, key) for its gradient;
        `weights`: the client part's shared state now, kept at the client's first recorded batch."""
        take = min(len(labels), self.limit - self._count)
        if take <= 0:
            return
        self._count += take
        if weights is not None and client_id not in self._weights:
            self._weights[client_id] = {name: t.detach().clone() for name, t in weights().items()}
        self._awaiting[client_id, key] = {
            "inputs": inputs[:take].detach().float(),
            "smashed": smashed[:take].detach(),
            "labels": labels[:take],
            "clients": torch.full((take,), client_id, dtype=torch.int64),
            "batches": torch.full((take,), len(self._batches) if take == len(labels) else -1, dtype=torch.int64),
        }
        self._batches.append(self._awaiting[client_id, key])

    def received(self, client_id: int, key: int, cut_grad: torch.Tensor) -> None:
        """The cut gradient of a recorded batch (a (1, ...) gradient is broadcast)."""
        batch = self._awaiting.pop((client_id, key), None)
        if batch is not None:
            take, grad = len(batch["labels"]), cut_grad.detach()
            batch["cut_grad"] = grad.expand(take, *grad.shape[1:]) if len(grad) == 1 else grad[:take]

    def received_tail(self, client_id: int, key: int, tail_grad: torch.Tensor) -> None:
        """U-shaped: the gradient at the second cut of a recorded batch, as the server receives it."""
        batch = self._awaiting.get((client_id, key))
        if batch is not None:
            batch["tail_grad"] = tail_grad.detach()[: len(batch["labels"])]

    def flush(self, run_dir: Path, rnd: int) -> None:
        """Write the round's record (nothing if nothing was sent) and start the next round empty."""
        batches, self._batches, self._awaiting, self._count = self._batches, [], {}, 0
        weights, self._weights = self._weights, {}
        if not batches:
            return
        names = set.intersection(*(set(b) for b in batches))  # a gradient only if every batch got one
        tensors = {n: torch.cat([b[n] for b in batches]) for n in sorted(names)}
        for client, state in weights.items():
            tensors.update({f"{WEIGHTS}.{client}.{name}": t.contiguous() for name, t in state.items()})
        save_safetensors(round_file(run_dir, rnd), tensors)


class PartyRecorder(Recorder):
    """`record=N` in a vertical run (setting=vertical): per party, its first N samples of the round
    as the server saw them: the party's embedding as the server decoded it (`smashed@j`), the
    gradient the server sent back (`cut_grad@j`, as the party decoded it) and the labels of those
    samples (`labels@j`, from the label holder's step), with the party's columns of the inputs
    (`inputs@j`, for scoring only: the server never sees them). Every party's batch holds the same
    rows (aligned), so party j's first N samples are every party's unless one dropped out."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self._counts: dict[int, int] = {}
        self._labels: dict[int, torch.Tensor] = {}  # by step, this round

    def sent(
        self,
        client_id: int,
        key: int,
        inputs: torch.Tensor,
        smashed: torch.Tensor,
        labels: torch.Tensor,
        weights: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        """A party's embedding of a batch (its `weights` are not kept: a vertical run's attacks use
        the final bottoms); `labels` are empty except at the label holder, whose
        labels (as it holds them, before `label_dp`: the truth the attacks are scored on) label
        every party's batch of that step."""
        take = min(len(inputs), self.limit - self._counts.get(client_id, 0))
        if take > 0:
            self._counts[client_id] = self._counts.get(client_id, 0) + take
            self._awaiting[client_id, key] = {
                "inputs": inputs[:take].detach().float(),
                "smashed": smashed[:take].detach(),
                "clients": torch.full((take,), client_id, dtype=torch.int64),
            }
            self._batches.append(self._awaiting[client_id, key])
        if len(labels):
            self.labelled(key, labels)
        elif key in self._labels and take > 0:
            self._awaiting[client_id, key]["labels"] = self._labels[key][:take].detach()

    def labelled(self, key: int, labels: torch.Tensor) -> None:
        """The labels of step `key`'s batch: the server's own (labels_at=server) or the label holder's."""
        self._labels[key] = labels
        for (_, step), batch in self._awaiting.items():
            if step == key:
                batch["labels"] = labels[: len(batch["inputs"])].detach()

    def received(self, client_id: int, key: int, cut_grad: torch.Tensor) -> None:
        batch = self._awaiting.pop((client_id, key), None)
        if batch is not None:
            batch["cut_grad"] = cut_grad.detach()[: len(batch["inputs"])]

    def flush(self, run_dir: Path, rnd: int) -> None:
        """Write the round's record, every party's tensors named `<name>@<party>` (a batch no step
        took, its label holder gone, is left out); nothing if nothing was recorded."""
        batches, self._batches, self._awaiting, self._counts, self._labels = self._batches, [], {}, {}, {}
        tensors: dict[str, torch.Tensor] = {}
        for party in sorted({int(b["clients"][0]) for b in batches}):
            kept = [b for b in batches if int(b["clients"][0]) == party and "labels" in b]
            if kept:
                names = set.intersection(*(set(b) for b in kept)) - {"clients"}
                tensors.update({f"{n}@{party}": torch.cat([b[n] for b in kept]) for n in sorted(names)})
        if tensors:
            save_safetensors(round_file(run_dir, rnd), tensors)
