"""Tables: scikit-learn's bundled breast-cancer data, and a user's CSV files with an id column.

A table's samples are rows of numeric features (input shape `(D,)`), standardised by the training
rows' mean and deviation. Vertical runs need each row's sample id and which cells are missing
(`table_ids`); a CSV gives both, a bundled dataset's ids are its rows' positions.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from splitlab.data.datasets import Dataset
from splitlab.errors import UserError, not_a_file, not_utf8
from splitlab.lazy import torch

CSV_FILES = ("train.csv", "test.csv")
ID_COLUMN, LABEL_COLUMN = "id", "label"


def _load_breast_cancer(data_dir: Path | None, seed: int) -> Dataset:
    """scikit-learn's breast-cancer table (569 rows, 30 features, 2 classes), seeded stratified 80/20."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    bunch = load_breast_cancer()
    x, y = bunch.data.astype(np.float64), bunch.target.astype(np.int64)
    tr_x, te_x, tr_y, te_y = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    return _standardised("breast_cancer", tr_x, tr_y, te_x, te_y)


def _standardised(name: str, tr_x: np.ndarray, tr_y: np.ndarray, te_x: np.ndarray, te_y: np.ndarray) -> Dataset:
    """Features scaled by the training rows' mean and deviation (ignoring missing cells), as float32;
    missing cells stay NaN."""
    mean = np.nanmean(tr_x, axis=0)
    std = np.nanstd(tr_x, axis=0)
    std[~(std > 0)] = 1.0
    scale = lambda x: torch.from_numpy(((x - mean) / std).astype(np.float32))  # noqa: E731
    classes = int(max(tr_y.max(initial=0), te_y.max(initial=0))) + 1
    return Dataset(
        name, scale(tr_x), torch.from_numpy(tr_y), scale(te_x), torch.from_numpy(te_y), classes, (tr_x.shape[1],)
    )


def read_table(
    path: Path, labels: bool = True, features: bool = True
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """A CSV file with a header: its feature columns' names, the ids (int64), the labels (float,
    NaN where empty; all NaN without a label column) and the features (float, NaN where empty).
    `labels`/`features`: whether the file must have a label column / feature columns, or must not
    (a vertical party's own file: labels only at the label holder; the server's: no features).
    UserError naming the file and row."""
    try:
        with path.open(newline="") as file:
            rows = list(csv.reader(file))
    except UnicodeDecodeError:
        raise UserError(f"CSV file {str(path)!r}, {not_utf8(path)}") from None
    except OSError as error:
        raise UserError(f"cannot read CSV file {str(path)!r}: {error}") from None
    if not rows:
        raise UserError(f"CSV file {str(path)!r} is empty; expected a header with {ID_COLUMN!r} and {LABEL_COLUMN!r}")
    header = [name.strip() for name in rows[0]]
    for needed in (ID_COLUMN, LABEL_COLUMN) if labels else (ID_COLUMN,):
        if needed not in header:
            raise UserError(f"CSV file {str(path)!r} has no {needed!r} column; its columns: {', '.join(header)}")
    if not labels and LABEL_COLUMN in header:
        raise UserError(
            f"CSV file {str(path)!r} has a {LABEL_COLUMN!r} column; only the label holder's (labels_at=) may"
        )
    names = [name for name in header if name not in (ID_COLUMN, LABEL_COLUMN)]
    if features and not names:
        raise UserError(f"CSV file {str(path)!r} has no feature columns besides {ID_COLUMN!r} and {LABEL_COLUMN!r}")
    if not features and names:
        raise UserError(
            f"CSV file {str(path)!r} has feature columns ({', '.join(names[:3])}...); the server's holds only "
            f"{ID_COLUMN!r} and {LABEL_COLUMN!r}"
        )
    id_at = header.index(ID_COLUMN)
    label_at = header.index(LABEL_COLUMN) if labels else None
    feature_at = [header.index(name) for name in names]
    ids, label_cells, values = [], [], []
    for line, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise UserError(f"{str(path)!r} line {line}: {len(row)} cells, the header has {len(header)}")
        try:
            ids.append(int(row[id_at]))
            label_cells.append(math.nan if label_at is None else _number(row[label_at]))
            values.append([_number(row[i]) for i in feature_at])
        except ValueError as error:
            raise UserError(f"{str(path)!r} line {line}: {error}; ids are integers, cells numbers or empty") from None
    label_array = np.asarray(label_cells, dtype=np.float64)
    known = label_array[~np.isnan(label_array)]
    if np.any(known < 0) or np.any(known != np.round(known)):
        raise UserError(f"{str(path)!r}: labels must be class numbers 0, 1, 2, ...")
    id_array = np.asarray(ids, dtype=np.int64)
    if len(np.unique(id_array)) != len(id_array):
        raise UserError(f"{str(path)!r}: an id appears twice; every row needs its own id")
    return names, id_array, label_array, np.asarray(values, dtype=np.float64).reshape(len(ids), len(names))


def _number(cell: str) -> float:
    cell = cell.strip()
    if not cell:
        return math.nan
    value = float(cell)
    if not math.isfinite(value):
        raise ValueError(f"{cell!r} is not a finite number")
    return value


def _csv_files(data_dir: Path | None) -> tuple[Path, Path]:
    if data_dir is None:
        raise UserError(f"dataset=csv reads {' and '.join(CSV_FILES)} from data_dir=; give data_dir=FOLDER")
    paths = tuple(data_dir / name for name in CSV_FILES)
    for path in paths:
        if not path.is_file():
            raise UserError(f"dataset=csv: {str(path)!r}: {not_a_file(path)}; data_dir needs {' and '.join(CSV_FILES)}")
    return paths[0], paths[1]


def _load_csv_table(data_dir: Path | None) -> tuple[Dataset, np.ndarray, np.ndarray]:
    """The CSV dataset with every training row (missing cells NaN, missing labels -1), its training
    ids, and its training rows whose label is known."""
    train_path, test_path = _csv_files(data_dir)
    names, ids, labels, x = read_table(train_path)
    test_names, _, test_labels, test_x = read_table(test_path)
    if test_names != names:
        raise UserError(f"dataset=csv: {str(test_path)!r}'s feature columns differ from {str(train_path)!r}'s")
    complete = ~np.isnan(test_x).any(axis=1) & ~np.isnan(test_labels)
    labelled = ~np.isnan(labels)
    dataset = _standardised(
        "csv",
        x,
        np.where(labelled, labels, -1).astype(np.int64),
        test_x[complete],
        test_labels[complete].astype(np.int64),
    )
    return dataset, ids, labelled


def _load_csv(data_dir: Path | None, seed: int) -> Dataset:
    """dataset=csv for a horizontal run: the training rows with a label and every cell."""
    dataset, _, labelled = _load_csv_table(data_dir)
    keep = torch.from_numpy(labelled & ~torch.isnan(dataset.train_x).any(dim=1).numpy())
    return Dataset(
        "csv",
        dataset.train_x[keep],
        dataset.train_y[keep],
        dataset.test_x,
        dataset.test_y,
        dataset.num_classes,
        dataset.input_shape,
    )


def table_ids(name: str, data_dir: Path | None, dataset: Dataset) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A dataset's training rows as a vertical run sees them: the id of each row, whether its label
    is known, and which of its cells are missing (rows x input features; images have none)."""
    count = len(dataset.train_y)
    if name != "csv":
        return np.arange(count, dtype=np.int64), np.ones(count, dtype=bool), np.zeros((count, 0), dtype=bool)
    full, ids, labelled = _load_csv_table(data_dir)
    return ids, labelled, torch.isnan(full.train_x).numpy()


def own_csv_table(
    data_dir: Path | None, labels: bool, features: bool
) -> tuple[Dataset, np.ndarray, np.ndarray, np.ndarray]:
    """A vertical run's own files (data=own: a party's columns, with the labels at the label
    holder; the server's ids and labels): every training row (missing cells NaN, missing labels
    -1, columns standardised as in the whole table), its training ids, which rows are labelled,
    and the ids of its test rows with every cell (and label), in the file's order."""
    train_path, test_path = _csv_files(data_dir)
    names, ids, train_labels, x = read_table(train_path, labels, features)
    test_names, test_ids, test_labels, test_x = read_table(test_path, labels, features)
    if test_names != names:
        raise UserError(f"data=own: {str(test_path)!r}'s feature columns differ from {str(train_path)!r}'s")
    complete = ~np.isnan(test_x).any(axis=1) & (~np.isnan(test_labels) if labels else True)
    labelled = ~np.isnan(train_labels)
    dataset = _standardised(
        "csv",
        x,
        np.where(labelled, train_labels, -1).astype(np.int64),
        test_x[complete],
        np.nan_to_num(test_labels[complete], nan=0.0).astype(np.int64),
    )
    return dataset, ids, labelled, test_ids[complete]


def csv_training_set(data_dir: Path | None) -> Dataset:
    """Every training row of a CSV dataset (missing cells NaN, missing labels -1): a vertical
    party's raw table before its samples are aligned."""
    return _load_csv_table(data_dir)[0]


LOADERS = {"breast_cancer": _load_breast_cancer, "csv": _load_csv}
LOCATORS = {
    "breast_cancer": lambda d: "bundled with scikit-learn",
    "csv": lambda d: str(_csv_files(d)[0].parent),
}
