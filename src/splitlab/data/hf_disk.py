"""`dataset=hf_disk data_dir=DIR`: a folder written by Hugging Face `datasets`' `save_to_disk`, a
`Dataset` or a `DatasetDict`, whose rows have the fields of one format of data/text_rows.py.

A DatasetDict's `train` split trains and its `test` split (else `validation`) tests; a Dataset,
or a DatasetDict with neither, has its test rows held out as a file without test_file is
(splitlab.data.language). Read with `datasets.load_from_disk` (memory-mapped Arrow files; the
`datasets` package of the `lm` extra)."""

from __future__ import annotations

from pathlib import Path

from splitlab.data.text_rows import Rows, read_rows
from splitlab.errors import UserError
from splitlab.json_text import user_json

TEST_SPLITS = ("test", "validation")


def check_folder(folder: Path | None) -> Path:
    if folder is None:
        raise UserError("dataset=hf_disk needs data_dir=DIR, a folder written by datasets' save_to_disk")
    if not folder.is_dir():
        raise UserError(f"dataset=hf_disk: data_dir={folder} is not a folder (one written by datasets' save_to_disk)")
    return folder


def _refuse_empty(folder: Path) -> None:
    """`save_to_disk` writes a split without rows as no data files, on which `load_from_disk` fails
    (an IndexError): refused here, naming the split."""
    for state in sorted([folder / "state.json", *folder.glob("*/state.json")]):
        if state.is_file():
            content = user_json(state.read_text(encoding="utf-8", errors="replace"), str(state))
            if isinstance(content, dict) and content.get("_data_files") == []:
                split = "" if state.parent == folder else f" (its {state.parent.name} split)"
                raise UserError(f"dataset=hf_disk: data_dir={folder}{split} holds no rows; every split needs rows")


def _load(folder: Path | None):
    folder = check_folder(folder)
    _refuse_empty(folder)
    try:
        from datasets import load_from_disk
    except ImportError:
        raise UserError("dataset=hf_disk reads with the `datasets` package: pip install 'splitlab[lm]'") from None
    try:
        return load_from_disk(str(folder))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise UserError(
            f"dataset=hf_disk: data_dir={folder} is not a folder written by datasets' save_to_disk "
            f"(a Dataset or a DatasetDict): {str(error).splitlines()[0]}"
        ) from None


def _rows(dataset, where: str) -> Rows:
    return read_rows(((f"{where}, row {i}", row) for i, row in enumerate(dataset)), where)


def locate(folder: Path | None) -> str:
    """Where the dataset is (for `splitlab datasets`), without reading its rows."""
    _load(folder)
    return str(folder)


def read_hf_disk(folder: Path) -> tuple[Rows, Rows | None]:
    """(the training rows, the test rows or None where the folder holds no test split)."""
    dataset = _load(folder)
    if not hasattr(dataset, "keys"):  # a Dataset
        return _rows(dataset, str(folder)), None
    splits = list(dataset.keys())
    if "train" not in splits:
        raise UserError(f"dataset=hf_disk: {folder} holds the splits {', '.join(splits)}; a train split is needed")
    test = next((name for name in TEST_SPLITS if name in splits), None)
    train_rows = _rows(dataset["train"], f"{folder} train split")
    return train_rows, None if test is None else _rows(dataset[test], f"{folder} {test} split")
