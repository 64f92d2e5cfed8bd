"""Datasets as in-memory tensors, a name -> loader registry, and offline file loaders.

Nothing here downloads: the machines are offline, so every loader reads a standard on-disk
format and, when the files are missing, raises a one-line `UserError` saying where it looked
and how to get them.
"""

from __future__ import annotations

import functools
import gzip
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from splitlab.data.download import FASHION_MNIST_FILES, cache_dir
from splitlab.data.idx import parse_idx
from splitlab.errors import UserError
from splitlab.lazy import torch
from splitlab.targets import IGNORED

#: Where the Debian package `dataset-fashion-mnist` puts its files.
FASHION_MNIST_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
#: Environment variable naming a data root (`$SPLITLAB_DATA/fashion_mnist`, `.../cifar-10-batches-bin`).
DATA_ENV = "SPLITLAB_DATA"

_FASHION_FILES = FASHION_MNIST_FILES
_FASHION_MEAN, _FASHION_STD = 0.2860, 0.3530
_CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"


class Prepared:
    """Stored samples that become model inputs when indexed: `x[idx]` is `prepare(stored[idx])`.

    A run's training inputs: the samples stay in their stored dtype (uint8 images) and only the
    mini-batch being used is converted, so memory follows the stored bytes, not float32 copies.
    `shape`, `dtype` (of the prepared inputs), `device`, `len`, `to` and `element_size` answer as a
    tensor of the prepared inputs would.
    """

    def __init__(self, stored: torch.Tensor, prepare: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.stored, self.prepare = stored, prepare
        self.dtype = prepare(stored[:0]).dtype

    def __getitem__(self, idx) -> torch.Tensor:
        return self.prepare(self.stored[idx])

    def __len__(self) -> int:
        return len(self.stored)

    @property
    def shape(self) -> torch.Size:
        return self.stored.shape

    @property
    def device(self) -> torch.device:
        return self.stored.device

    def to(self, device: torch.device | str) -> Prepared:
        return Prepared(self.stored.to(device), self.prepare)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def scale_and_normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 images (N, C, H, W) -> float32 `(x / 255 - mean) / std` per channel, computed with the
    same float32 operations in the same order as when whole datasets were converted at load time,
    so the values are bit for bit those."""
    x = x.float().div_(255.0)
    if len(mean) == 1:
        return x.sub_(mean[0]).div_(std[0])
    shape = (1, len(mean), 1, 1)
    return x.sub_(torch.tensor(mean, device=x.device).view(shape)).div_(torch.tensor(std, device=x.device).view(shape))


@dataclass(frozen=True)
class References:
    """Test prompts with their reference texts, what a dataset whose test rows have references
    exposes for `eval_generate` (BLEU, ROUGE-L): the model continues `prompts[i]` (token ids) until
    `tokenizer.eos_token_id` and `tokenizer.decode` of the continuation is scored against
    `texts[i]` (one or more references)."""

    prompts: list[list[int]]
    texts: list[list[str]]
    tokenizer: Any  # decode(ids) -> str and eos_token_id: a Hugging Face tokenizer or CharacterTokenizer


@dataclass(frozen=True, eq=False)
class Dataset:
    """A whole dataset in memory. `eq=False`: comparing tensors field by field is meaningless.

    `train_x` and `test_x` hold the samples as stored (uint8 images for Fashion-MNIST and CIFAR);
    `prepare` turns a batch of them into model inputs (float32, normalized); None means they are
    model inputs already.
    """

    name: str
    train_x: torch.Tensor  # stored samples (N, C, H, W) / (N, D) / tokens (N, T)
    train_y: torch.Tensor  # int64 (N,) classes / (N, T) next tokens, -100 where not in the loss
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]  # shape of one sample, e.g. (1, 28, 28)
    train_groups: list[np.ndarray] | None = None  # natural per-user partition (LEAF datasets)
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None  # stored batch -> model inputs
    #: what a batch holds and is measured by: "classification" (a class per sample) or "language"
    #: (a next token per position, those not in the loss marked IGNORED; splitlab.metrics)
    task: str = "classification"
    vocabulary: str | None = None  # language task with characters as tokens: token i is vocabulary[i]
    references: References | None = (
        None  # test prompts and their references (e2e, jsonl / hf_disk rows), for eval_generate
    )
    #: language task: the rows a prompt is encoded as (splitlab.data.language.encode_prompt): text
    #: (as it is), prompt/completion ([bos] prompt), messages (the chat template) or e2e
    rows: str = "text"
    #: packing=true: the training sequences' segment ids (N, T), which row of its sequence each
    #: position holds (data/text_rows.py `pack`); None: one row per sequence
    train_segments: torch.Tensor | None = None

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """Model inputs from a batch of stored samples."""
        return x if self.prepare is None else self.prepare(x)

    @property
    def train_labels(self) -> torch.Tensor:
        """One class per training sample, what partitions and reports count: a language task's
        sequences are all of one class (0), so only partitions that ignore classes apply."""
        return self.train_y if self.task == "classification" else self.train_y.new_zeros(len(self.train_y))

    def __post_init__(self) -> None:
        """Catch a malformed dataset where it is built rather than deep inside training."""
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            target_shape = self.input_shape if self.task == "language" else ()
            if (
                len(x) != len(y)
                or tuple(x.shape[1:]) != self.input_shape
                or tuple(y.shape[1:]) != target_shape
                or y.dtype != torch.int64
            ):
                raise ValueError(
                    f"dataset {self.name!r} {split} split is malformed: x {tuple(x.shape)}, "
                    f"y {tuple(y.shape)} {y.dtype}, input_shape {self.input_shape}"
                )


#: task -> the keys of `data_summary`
SUMMARY_KEYS = {"classification": ("class_counts",), "language": ("sequences", "token_counts")}


def data_summary(targets: torch.Tensor, task: str, num_classes: int) -> dict[str, Any]:
    """What identifies a client's samples by their targets, the same where they are and where the
    run is planned: the count of each class; for a language task the number of sequences and the
    count of each token id in the loss (IGNORED positions are not counted)."""
    targets = targets.cpu()
    if task == "language":
        tokens = targets[targets != IGNORED]
        return {"sequences": len(targets), "token_counts": torch.bincount(tokens, minlength=num_classes).tolist()}
    return {"class_counts": torch.bincount(targets, minlength=num_classes).tolist()}


# ---------------------------------------------------------------------------------------------
# File search


def _roots(data_dir: Path | None) -> list[Path]:
    """The user's data roots: `data_dir` if given (it alone is searched), else `$SPLITLAB_DATA`."""
    if data_dir is not None:
        return [data_dir]
    env = os.environ.get(DATA_ENV)
    return [Path(env).expanduser()] if env else []


def _existing(folder: Path, name: str) -> Path | None:
    """`folder/name`, or the same file un-gzipped, whichever exists."""
    for candidate in (folder / name, folder / name.removesuffix(".gz")):
        if candidate.is_file():
            return candidate
    return None


def _looked_in(candidates: list[Path]) -> str:
    if candidates:
        return ", ".join(str(c) for c in candidates)
    return f"nowhere (no data_dir given and ${DATA_ENV} unset)"


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST (gzipped IDX)


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """Read a uint8 IDX file (gzipped if it ends in .gz) with `ndim` dimensions."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        raise UserError(f"cannot read IDX file {path}: {e}") from None
    return parse_idx(raw, ndim, path)


def _find_fashion_mnist(data_dir: Path | None, files: tuple[str, ...] = _FASHION_FILES) -> Path:
    """First folder holding all `files`: data_dir (or its fashion_mnist/ subfolder), else
    $SPLITLAB_DATA/fashion_mnist, else the Debian package's folder."""
    candidates = [c for r in _roots(data_dir) for c in (r, r / "fashion_mnist", r / "fashion-mnist")]
    if data_dir is None:
        candidates += [FASHION_MNIST_SYSTEM_DIR, cache_dir() / "fashion_mnist"]
    for folder in candidates:
        if all(_existing(folder, f) for f in files):
            return folder
    raise UserError(
        f"fashion_mnist files not found; looked in {_looked_in(candidates)}; get them with "
        f"'apt-get install dataset-fashion-mnist', 'splitlab download fashion_mnist' (online), "
        f"or pass data_dir=DIR holding "
        f"{', '.join(files)} (gzipped or not)"
    )


@functools.cache
def _read_fashion_split(folder: Path, images_name: str, labels_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Parse once per folder, so loads with different seeds share the same tensors."""
    # _find_fashion_mnist saw both; a file removed since then is a read error naming it
    images_path, labels_path = (_existing(folder, n) or folder / n for n in (images_name, labels_name))
    images, labels = read_idx(images_path, 3), read_idx(labels_path, 1)
    if len(images) != len(labels):
        raise UserError(f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    if labels.max(initial=0) > 9:
        raise UserError(f"{labels_path} has label {labels.max()}; fashion_mnist labels are 0..9")
    x = torch.from_numpy(images.copy()).unsqueeze(1)  # uint8; `prepare` scales and normalizes
    return x, torch.from_numpy(labels.astype(np.int64))


def _fashion_mnist(train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor]) -> Dataset:
    (train_x, train_y), (test_x, test_y) = train, test
    return Dataset(
        "fashion_mnist",
        train_x,
        train_y,
        test_x,
        test_y,
        10,
        tuple(train_x.shape[1:]),
        prepare=functools.partial(scale_and_normalize, mean=(_FASHION_MEAN,), std=(_FASHION_STD,)),
    )


def _load_fashion_mnist(data_dir: Path | None, seed: int) -> Dataset:
    folder = _find_fashion_mnist(data_dir)
    return _fashion_mnist(
        _read_fashion_split(folder, *_FASHION_FILES[:2]), _read_fashion_split(folder, *_FASHION_FILES[2:])
    )


def _load_fashion_mnist_split(data_dir: Path | None, split: str) -> Dataset:
    files = _FASHION_FILES[:2] if split == "train" else _FASHION_FILES[2:]
    samples = _read_fashion_split(_find_fashion_mnist(data_dir, files), *files)
    none = tuple(t[:0] for t in samples)
    return _fashion_mnist(samples, none) if split == "train" else _fashion_mnist(none, samples)


# ---------------------------------------------------------------------------------------------
# CIFAR-10 / CIFAR-100 (binary version: fixed-size records of label byte(s) + 3072 pixel bytes)


@dataclass(frozen=True)
class _CifarFormat:
    folder: str  # the folder the binary-version archive unpacks to
    train_files: tuple[str, ...]
    test_file: str
    label_bytes: int  # label bytes before the pixels of each record
    label_index: int  # which of them is the label used (CIFAR-100: the fine one)
    num_classes: int
    title: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    pickle_folder: str  # the python version (pickled), which is refused
    pickle_files: tuple[str, ...]

    @property
    def record_size(self) -> int:
        return self.label_bytes + _CIFAR_PIXELS

    @property
    def files(self) -> tuple[str, ...]:
        return (*self.train_files, self.test_file)


_CIFAR_PIXELS = 3 * 32 * 32  # 1024 R, 1024 G, 1024 B bytes, each a row-major 32x32 plane
_CIFAR100_COARSE_CLASSES = 20

_CIFAR = {
    "cifar10": _CifarFormat(
        "cifar-10-batches-bin",
        tuple(f"data_batch_{i}.bin" for i in range(1, 6)),
        "test_batch.bin",
        1,
        0,
        10,
        "CIFAR-10",
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
        "cifar-10-batches-py",
        (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"),
    ),
    "cifar100": _CifarFormat(
        "cifar-100-binary",
        ("train.bin",),
        "test.bin",
        2,  # coarse label, fine label
        1,
        100,
        "CIFAR-100",
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
        "cifar-100-python",
        ("train", "test"),
    ),
}


def _starts_like_a_pickle(path: Path) -> bool:
    """Whether `path` starts with the pickle PROTO opcode; only that byte is read, nothing unpickled."""
    try:
        with path.open("rb") as f:
            return f.read(1) == b"\x80"
    except OSError:
        return False


def _pickled_cifar(fmt: _CifarFormat, roots: list[Path]) -> Path | None:
    """A folder holding the python version's files, recognized by their names and first byte."""
    for folder in (c for r in roots for c in (r, r / fmt.pickle_folder)):
        if all(_starts_like_a_pickle(folder / f) for f in fmt.pickle_files):
            return folder
    return None


def _find_cifar(name: str, data_dir: Path | None, files: tuple[str, ...] = ()) -> Path:
    """The folder holding `files` (default: all of them); data_dir may be the unpacked folder itself or its parent."""
    fmt = _CIFAR[name]
    files = files or fmt.files
    roots = _roots(data_dir)
    candidates = [c for r in roots for c in (r, r / fmt.folder)]
    missing = {}
    for folder in candidates:
        missing[folder] = [f for f in files if not (folder / f).is_file()]
        if not missing[folder]:
            return folder
    pickled = _pickled_cifar(fmt, roots)
    if pickled is not None:
        raise UserError(
            f"{name}: {pickled} holds the {fmt.title} python version ({', '.join(fmt.pickle_files)}), which are "
            f"pickle files that splitlab will not load; get the {fmt.title} binary version from {_CIFAR_URL} "
            f"({fmt.folder}/ with {', '.join(fmt.files)}) and pass data_dir=DIR"
        )
    how = (
        f"download the {fmt.title} binary version from {_CIFAR_URL}, unpack it into DIR and pass data_dir=DIR "
        f"(it needs {fmt.folder}/ with {', '.join(fmt.files)})"
    )
    if not candidates:
        raise UserError(f"{name} files not found; looked {_looked_in(candidates)}; {how}")
    closest = min(candidates, key=lambda c: len(missing[c]))
    raise UserError(
        f"{name} file {closest / missing[closest][0]} is missing; looked in {_looked_in(candidates)}; {how}"
    )


def _read_cifar_file(path: Path, fmt: _CifarFormat) -> tuple[np.ndarray, np.ndarray]:
    """One binary-version file -> (pixels (N, 3072) uint8, labels (N,) int64), validated."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise UserError(f"cannot read {fmt.title} file {path}: {e}") from None
    if len(raw) == 0 or len(raw) % fmt.record_size:
        raise UserError(
            f"{fmt.title} file {path} has {len(raw)} bytes, not a whole number of {fmt.record_size}-byte records "
            f"({fmt.label_bytes} label byte(s) + {_CIFAR_PIXELS} pixel bytes); it is truncated, corrupt or not "
            f"the {fmt.title} binary version"
        )
    records = raw.reshape(-1, fmt.record_size)
    label_ranges = [(fmt.label_index, fmt.num_classes, "label")]
    if fmt.label_bytes == 2:
        label_ranges.append((0, _CIFAR100_COARSE_CLASSES, "coarse label"))
    for column, classes, what in label_ranges:
        bad = np.flatnonzero(records[:, column] >= classes)
        if len(bad):
            raise UserError(
                f"{fmt.title} file {path} has {what} {records[bad[0], column]} in record {bad[0]}; "
                f"{what}s are 0..{classes - 1} (corrupt or not the {fmt.title} binary version)"
            )
    return records[:, fmt.label_bytes :], records[:, fmt.label_index].astype(np.int64)


@functools.cache
def _read_cifar_split(name: str, folder: Path, files: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Parse once per folder (uint8); rows are 1024 R, 1024 G, 1024 B bytes, each row-major 32x32."""
    fmt = _CIFAR[name]
    parts = [_read_cifar_file(folder / f, fmt) for f in files]
    data = np.concatenate([p[0] for p in parts]).reshape(-1, 3, 32, 32)  # a contiguous copy
    return torch.from_numpy(data), torch.from_numpy(np.concatenate([p[1] for p in parts]))  # x uint8


def _cifar(name: str, train: tuple[torch.Tensor, torch.Tensor], test: tuple[torch.Tensor, torch.Tensor]) -> Dataset:
    fmt = _CIFAR[name]
    return Dataset(
        name,
        *train,
        *test,
        fmt.num_classes,
        (3, 32, 32),
        prepare=functools.partial(scale_and_normalize, mean=fmt.mean, std=fmt.std),
    )


def _cifar_loader(name: str) -> Callable[[Path | None, int], Dataset]:
    def load(data_dir: Path | None, seed: int) -> Dataset:
        fmt = _CIFAR[name]
        folder = _find_cifar(name, data_dir)
        return _cifar(
            name, _read_cifar_split(name, folder, fmt.train_files), _read_cifar_split(name, folder, (fmt.test_file,))
        )

    return load


def _cifar_split_loader(name: str) -> Callable[[Path | None, str], Dataset]:
    def load(data_dir: Path | None, split: str) -> Dataset:
        fmt = _CIFAR[name]
        files = fmt.train_files if split == "train" else (fmt.test_file,)
        samples = _read_cifar_split(name, _find_cifar(name, data_dir, files), files)
        none = tuple(t[:0] for t in samples)
        return _cifar(name, samples, none) if split == "train" else _cifar(name, none, samples)

    return load


# ---------------------------------------------------------------------------------------------
# Built-in datasets


def _load_digits(data_dir: Path | None, seed: int) -> Dataset:
    """scikit-learn's 8x8 digits, seeded stratified 80/20 split, normalized by train statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = (bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    y = bunch.target.astype(np.int64)
    tr_x, te_x, tr_y, te_y = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    mean, std = tr_x.mean(), tr_x.std()
    return Dataset(
        "digits",
        torch.from_numpy((tr_x - mean) / std),
        torch.from_numpy(tr_y),
        torch.from_numpy((te_x - mean) / std),
        torch.from_numpy(te_y),
        10,
        (1, 8, 8),
    )


def _load_synthetic(data_dir: Path | None, seed: int) -> Dataset:
    """10 Gaussian classes in 8x8 "images" (for unit tests): each class has its own random mean
    image plus noise, pixels roughly zero-mean unit-variance; a linear model gets ~99% test."""
    rng = np.random.default_rng(seed)
    means = rng.normal(0.0, 0.6, size=(10, 1, 8, 8))

    def draw(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = rng.permutation(np.repeat(np.arange(10), per_class))
        x = means[y] + rng.normal(0.0, 0.8, size=(len(y), 1, 8, 8))
        return torch.from_numpy(x.astype(np.float32)), torch.from_numpy(y.astype(np.int64))

    (train_x, train_y), (test_x, test_y) = draw(120), draw(30)
    return Dataset("synthetic", train_x, train_y, test_x, test_y, 10, (1, 8, 8))


# ---------------------------------------------------------------------------------------------
# Registry

#: name -> loader(data_dir, seed). Adding a dataset is one entry here.
DATASETS: dict[str, Callable[[Path | None, int], Dataset]] = {
    "cifar10": _cifar_loader("cifar10"),
    "cifar100": _cifar_loader("cifar100"),
    "digits": _load_digits,
    "fashion_mnist": _load_fashion_mnist,
    "synthetic": _load_synthetic,
}

#: name -> loader(data_dir, "train" | "test") of one split alone, the other left empty: for datasets
#: whose files keep the splits apart, so that a client can hold only its own training samples
#: (data=own) and a server only the test set.
SPLIT_LOADERS: dict[str, Callable[[Path | None, str], Dataset]] = {
    "cifar10": _cifar_split_loader("cifar10"),
    "cifar100": _cifar_split_loader("cifar100"),
    "fashion_mnist": _load_fashion_mnist_split,
}

#: Optional: name -> locator(data_dir) returning where the data is (UserError if it is not
#: there), so `dataset_availability` need not load big datasets. Without one, it tries a load.
LOCATORS: dict[str, Callable[[Path | None], str]] = {
    "cifar10": lambda d: str(_find_cifar("cifar10", d)),
    "cifar100": lambda d: str(_find_cifar("cifar100", d)),
    "digits": lambda d: "bundled with scikit-learn",
    "fashion_mnist": lambda d: str(_find_fashion_mnist(d)),
    "synthetic": lambda d: "generated from the seed",
}

#: The kinds of sample a dataset may hold, and a model take (splitlab.models.MODEL_INPUTS).
SAMPLE_KINDS = ("images", "features", "tokens")
#: name -> what one sample of it is (a dataset not here: not declared, checked when a model is built)
SAMPLES: dict[str, str] = {
    **dict.fromkeys(["fashion_mnist", "cifar10", "cifar100", "digits", "synthetic"], "images"),
    **dict.fromkeys(["femnist", "celeba"], "images"),
    **dict.fromkeys(["breast_cancer", "csv"], "features"),
    **dict.fromkeys(["shakespeare", "shakespeare_lm", "e2e"], "tokens"),
}

# The LEAF datasets (femnist, celeba, shakespeare) live in their own modules, which build on the
# definitions above; splitlab.data (run before any of its modules) adds them here.


def register_dataset(
    name: str,
    loader: Callable[[Path | None, int], Dataset],
    *,
    split_loader: Callable[[Path | None, str], Dataset] | None = None,
    locator: Callable[[Path | None], str] | None = None,
    samples: str | None = None,
) -> None:
    """Make `dataset=name` load `loader(data_dir, seed)`; optionally its `split_loader(data_dir,
    "train" | "test")` (for data=own) and its `locator(data_dir)` (for `splitlab datasets`), the
    three registry entries in one call; `samples`: what one sample is (images, features or tokens),
    so that a model that cannot take it is refused before loading. A plugin's name may be registered
    again (the later loader counts), a built-in one may not."""
    if not name.isidentifier() or name in BUILT_IN:
        raise UserError(f"cannot register dataset {name!r}: expected a new name (letters, digits, _), not a built-in")
    DATASETS[name] = loader
    for registry in (SPLIT_LOADERS, LOCATORS, SAMPLES):
        registry.pop(name, None)
    if samples is not None:
        if samples not in SAMPLE_KINDS:
            raise UserError(
                f"cannot register dataset {name!r}: samples={samples!r} is not one of {', '.join(SAMPLE_KINDS)}"
            )
        SAMPLES[name] = samples
    if split_loader is not None:
        SPLIT_LOADERS[name] = split_loader
    if locator is not None:
        LOCATORS[name] = locator
    _load_cached.cache_clear()  # a name registered again must not return the earlier loader's data


@dataclass(frozen=True)
class TextSource:
    """What a language dataset's loader takes: where its text is, how it is tokenised and cut."""

    data_dir: Path | None = None
    seq_len: int | None = None  # tokens per sequence; None: the dataset's default
    tokenizer_dir: str | None = None  # model=hf's folder, whose tokenizer tokenises; None: LEAF's characters
    data_file: Path | None = None  # dataset=jsonl
    test_file: Path | None = None
    truncation: str = "refuse"  # rows longer than a sequence: refuse | left | right (data/text_rows.py)
    packing: bool = False  # several training rows to a sequence (data/text_rows.py `pack`)


#: Language datasets (shakespeare_lm, e2e, jsonl, hf_disk): name -> loader(TextSource), registered
#: by splitlab.data.
SEQUENCE_DATASETS: dict[str, Callable[[TextSource], Dataset]] = {}
#: splitlab's own dataset names (filled by splitlab.data once it has registered them all): never
#: replaced by a plugin
BUILT_IN: set[str] = set()


def dataset_names() -> list[str]:
    """Registered dataset names, sorted."""
    return sorted(DATASETS)


def _resolve(data_dir: str | os.PathLike | None) -> Path | None:
    return None if data_dir is None else Path(data_dir).expanduser().resolve()


def _check_name(name: str) -> None:
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; available: {', '.join(dataset_names())}")


def load_dataset(
    name: str,
    data_dir: str | os.PathLike | None = None,
    seed: int = 0,
    seq_len: int | None = None,
    tokenizer_dir: str | None = None,
    data_file: str | os.PathLike | None = None,
    test_file: str | os.PathLike | None = None,
    truncation: str = "refuse",
    packing: bool = False,
) -> Dataset:
    """Load a registered dataset; repeated calls with the same arguments return the cached one.
    `seq_len`: tokens per sequence of a language dataset (None: its default); refused for others.
    `tokenizer_dir`: a language dataset is tokenised by the tokenizer in that model folder (model=hf).
    `data_file`, `test_file`: the files of dataset=jsonl; `truncation`: how rows longer than a
    sequence are cut (data/text_rows.py); `packing`: several training rows to a sequence."""
    _check_name(name)
    if seq_len is not None and name not in SEQUENCE_DATASETS:
        raise UserError(f"seq_len= applies to language datasets ({', '.join(sorted(SEQUENCE_DATASETS))}), not {name}")
    source = TextSource(
        _resolve(data_dir), seq_len, tokenizer_dir, _resolve(data_file), _resolve(test_file), truncation, packing
    )
    return _load_cached(name, seed, os.environ.get(DATA_ENV), source)


def load_split(name: str, split: str, data_dir: str | os.PathLike | None = None) -> Dataset:
    """The `split` ("train" or "test") of a dataset, read from its own files alone: all the
    training samples in a client's data_dir (data=own), or a server's test set."""
    _check_name(name)
    if name not in SPLIT_LOADERS:
        raise UserError(
            f"data=own reads each client's own files in the dataset's format; {name!r} has no such files; "
            f"allowed datasets: {', '.join(sorted(SPLIT_LOADERS))}"
        )
    return SPLIT_LOADERS[name](_resolve(data_dir), split)


@functools.cache
def _load_cached(name: str, seed: int, env_root: str | None, source: TextSource) -> Dataset:
    """`env_root` is only part of the key: a changed $SPLITLAB_DATA must not hit a stale entry."""
    if name in SEQUENCE_DATASETS:
        return SEQUENCE_DATASETS[name](source)
    return DATASETS[name](source.data_dir, seed)


def dataset_availability(data_dir: str | os.PathLike | None = None) -> list[dict]:
    """One `{"name", "available", "where"}` per dataset: where it was found, or how to get it."""
    root = _resolve(data_dir)
    rows = []
    for name in dataset_names():
        try:
            if name in LOCATORS:
                where = LOCATORS[name](root)
            else:
                load_dataset(name, root)
                where = "loads without extra files"
            rows.append({"name": name, "available": True, "where": where})
        except UserError as e:
            rows.append({"name": name, "available": False, "where": str(e)})
    return rows
