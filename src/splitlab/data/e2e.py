"""The E2E NLG Challenge data (Novikova et al., 2017) as token sequences with a loss mask.

The release's `trainset.csv`, `devset.csv` and `testset_w_refs.csv` are CSV files with a header
and the columns `mr` (a meaning representation: `name[The Eagle], eatType[coffee shop], ...`) and
`ref` (a human reference text for it); the test set repeats an `mr` on one row per reference, and
every row is a sample here.

A sample is the causal-LM sequence `[bos] context completion`: the context is the meaning
representation followed by `SEPARATOR`, the completion is a space, the reference and the
tokenizer's end-of-sequence token, each tokenised on its own so that no token spans the two;
`bos` is the tokenizer's beginning-of-sequence token where it has one (GPT-2: `<|endoftext|>`,
Llama: `<s>`). The loss is on the completion only (the masked cross-entropy of the LoRA and
FSL-SAGE papers): `mask[i, j]` is true where the target `tokens[i, j + 1]` belongs to the completion.

For `eval_generate`, `references` gives each test meaning representation once as a prompt (its
context) with all its references: the test set repeats an `mr` on one row per reference.

Lengths: every sequence is `seq_len + 1` tokens, so that inputs `tokens[:, :-1]` and targets
`tokens[:, 1:]` are `seq_len` long. Shorter ones are padded at the end with the tokenizer's pad
token, or its end-of-sequence token where it has none (`pad_id`); padding is never a target.
Longer ones are cut at `seq_len + 1` tokens, which drops the end of the reference (and its
end-of-sequence token); a `seq_len` that leaves no reference token after some meaning
representation is refused.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from splitlab.data import text_rows
from splitlab.errors import UserError, not_a_file, not_utf8
from splitlab.lazy import torch

FILES = {"train": "trainset.csv", "dev": "devset.csv", "test": "testset_w_refs.csv"}
COLUMNS = ("mr", "ref")
SEPARATOR = " ||"


def read_pairs(path: str | Path) -> list[tuple[str, str]]:
    """The (mr, ref) rows of one E2E file, in file order."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: {not_a_file(path)} (the E2E NLG release's {', '.join(FILES.values())})")
    try:
        with path.open(newline="", encoding="utf-8-sig") as file:
            reader = csv.DictReader(file)
            if reader.fieldnames is None or not set(COLUMNS) <= set(reader.fieldnames):
                raise UserError(f"{path}: expected a header with the columns mr and ref; found {reader.fieldnames}")
            pairs = []
            for row in reader:
                mr, ref = row["mr"], row["ref"]
                if not mr or not ref:
                    raise UserError(f"{path}, line {reader.line_num}: a row without its mr or ref")
                pairs.append((mr, ref))
    except UnicodeDecodeError:
        raise UserError(f"{path}, {not_utf8(path)}") from None
    if not pairs:
        raise UserError(f"{path}: no rows")
    return pairs


def encode_pairs(
    pairs: list[tuple[str, str]],
    tokenizer: Any,
    seq_len: int,
    title: str = "tokenising e2e",
    truncation: str = "refuse",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens int64 (N, seq_len + 1), mask bool (N, seq_len)) of the pairs, as the module docstring
    says; `title` names the work in progress lines."""
    prompts = [(mr + SEPARATOR, " " + ref) for mr, ref in pairs]
    wheres = [f"E2E sample {i + 1}" for i in range(len(pairs))]
    return text_rows.completion_sequences(prompts, wheres, tokenizer, seq_len, title, truncation)


def references(pairs: list[tuple[str, str]], tokenizer: Any) -> tuple[list[list[int]], list[list[str]]]:
    """(prompts, references) of the test rows as `eval_generate` reads them: each meaning
    representation once (in file order) as the prompt `[bos] mr + SEPARATOR`, with all of its references."""
    by_mr: dict[str, list[str]] = {}
    for mr, ref in pairs:
        by_mr.setdefault(mr, []).append(ref)
    return prompt_ids(tokenizer, list(by_mr)), list(by_mr.values())


def prompt_ids(tokenizer: Any, mrs: list[str]) -> list[list[int]]:
    """The contexts samples begin with, `[bos] mr + SEPARATOR`, as token ids: what is continued."""
    return text_rows.prompt_ids(tokenizer, "prompt/completion", [mr + SEPARATOR for mr in mrs])


def load_e2e(
    data_dir: str | Path, split: str, tokenizer: Any, seq_len: int, truncation: str = "refuse"
) -> tuple[torch.Tensor, torch.Tensor]:
    """`split` ("train", "dev" or "test") of the E2E release in `data_dir`, encoded by `encode_pairs`."""
    if split not in FILES:
        raise ValueError(f"unknown E2E split {split!r}; one of {', '.join(FILES)}")
    pairs = read_pairs(Path(data_dir) / FILES[split])
    return encode_pairs(pairs, tokenizer, seq_len, f"tokenising e2e {split}", truncation)
