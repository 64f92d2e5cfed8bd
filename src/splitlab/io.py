"""Atomic file writes: a crash leaves the old file or the new one, never half of either.

Temporary files and folders are named `.<name>.<random>.tmp` beside their target (`TEMP_GLOB`), and
a folder being replaced is first renamed aside to `.<name>.old.tmp`, so that what a killed process
left can be found: `recover` puts an old folder back where its replacement never arrived and
removes the rest. Finished files and folders get the permissions the umask allows (not mkstemp's
0600 or mkdtemp's 0700); JSON is strict (NaN or inf is a bug, not a number to write).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from splitlab.lazy import torch

TEMP_GLOB = ".*.tmp"
#: the suffix of a folder renamed aside while its replacement moves in (`.<name>.old.tmp`)
ASIDE = ".old.tmp"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _atomic(path: Path, write: Callable[[str], object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as error:  # named after the file it was for, not its temporary name
        Path(tmp).unlink(missing_ok=True)
        raise OSError(error.errno, error.strerror, str(path)) from error
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_folder(path: Path) -> Iterator[Path]:
    """A temporary sibling folder to write into, moved into place whole when the block ends without
    an error, and removed when it does not: never half a folder. What was there is renamed aside
    first and removed last, so a kill at any instant leaves, under `path`, the old folder or the new
    one whole, or (between the two renames) the old one aside, which `recover` puts back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        aside = path.parent / f".{path.name}{ASIDE}"
        _recover_aside(aside)
        if path.exists() or path.is_symlink():
            os.rename(path, aside)
        os.rename(tmp, path)
        remove(aside)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove(path: Path) -> None:
    """A file, link or folder (with all it holds), if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def recover(folder: Path) -> None:
    """Undo what atomic writes into `folder` left when their process was killed: a folder renamed
    aside goes back where its replacement never arrived (else it is removed), and every temporary
    file or folder is removed."""
    for aside in sorted(folder.glob(f".*{ASIDE}")):
        _recover_aside(aside)
    for tmp in sorted(folder.glob(TEMP_GLOB)):
        remove(tmp)


def _recover_aside(aside: Path) -> None:
    if not (aside.exists() or aside.is_symlink()):
        return
    target = aside.parent / aside.name[1 : -len(ASIDE)]
    if target.exists() or target.is_symlink():
        remove(aside)
    else:
        os.rename(aside, target)


def write_bytes(path: Path, data: bytes) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_bytes(data))


def write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


def write_png(path: Path, figure: Any) -> None:
    """A matplotlib figure as a PNG."""
    _atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=90, bbox_inches="tight"))


def write_json(path: Path, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def write_jsonl(path: Path, rows: list[dict]) -> None:
    write_text(path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in rows))


def write_yaml(path: Path, obj: Any) -> None:
    write_text(path, yaml.safe_dump(obj, sort_keys=False))


def save_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    write_safetensors(path, {name: cpu_copy(t) for name, t in tensors.items()})


def cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy with a storage of its own (what safetensors writes), made in one copy."""
    return tensor.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Streams CPU tensors, each contiguous with a storage of its own, from their memory to the file."""
    from safetensors.torch import save_file

    _atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
