"""Packed sequences: several rows in one sequence, attention and positions kept within each row.

A packed batch comes with segment ids (B, T): which row of its sequence each position belongs to
(data/text_rows.py `pack`). The stages that attend (gpt.py's and hf.py's blocks) or place
positions (their embeddings) read them here, set around the forward pass on that batch by whoever
runs the stages (`rows`), so every stage keeps its one input (the hidden states) and the parts on
either side of a cut read the ids alike, the server's from what it receives about the batch.
Without ids (every unpacked batch) the stages are exactly as before: one row per sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_SEGMENTS: ContextVar[torch.Tensor | None] = ContextVar("segments", default=None)


@contextlib.contextmanager
def rows(segments: torch.Tensor | None) -> Iterator[None]:
    """Stages run inside see `segments` (int64 (B, T), nondecreasing along T) as the batch's rows."""
    token = _SEGMENTS.set(segments)
    try:
        yield
    finally:
        _SEGMENTS.reset(token)


def segments() -> torch.Tensor | None:
    """The segment ids of the batch being run, or None (one row per sequence)."""
    return _SEGMENTS.get()


def positions(length: int, device: torch.device) -> torch.Tensor:
    """Position ids, (1, T) counting from 0, or with segment ids (B, T) counting from 0 at each row's start."""
    index = torch.arange(length, device=device)
    ids = segments()
    if ids is None:
        return index.unsqueeze(0)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def other_rows(length: int, device: torch.device) -> torch.Tensor:
    """Where a query may not look, bool (B or 1, 1, T, T): the future, and with segment ids other rows."""
    future = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]
    ids = segments()
    return future if ids is None else future | (ids[:, None, :, None] != ids[:, None, None, :])
