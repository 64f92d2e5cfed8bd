"""A run directory's safety rules: usable before any work, one writer at a time, nothing stale.

- `check_out_dir` refuses an out= that can never become a directory (an existing file, a path
  under a file, a place nobody can write) before data is loaded or anything is written.
- `locked` holds an exclusive lock on OUT/.lock (fcntl.flock, released by the kernel when its
  process dies, so a dead run's lock is simply taken over; the file is removed when the run ends).
  A second process is refused with one line naming the holder's PID and host. While holding it,
  temporary files left by a killed writer (splitlab.io's `.<name>.<random>.tmp`) are removed.
- `WRITTEN` is every file a run or `evaluate` writes, for `overwrite=true` to remove.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from splitlab.errors import UserError
from splitlab.io import TEMP_GLOB
from splitlab.runfiles import RUN_FILES

LOCK = ".lock"
#: Every file or folder a run (engine, its trackers) or `splitlab evaluate` writes into its directory.
WRITTEN = (
    *RUN_FILES,
    "metrics.csv",
    "evaluation.json",
    "tensorboard",
    "mlruns",
    "wandb",
    "record",
    "attack.json",
    "attack_inversion.png",
    "hf",
    "report.md",
    "results.csv",
    "plots",
)


def check_out_dir(path: Path) -> None:
    """UserError unless `path` is a directory or could be made one here."""
    if path.exists():
        if not path.is_dir():
            raise UserError(f"out {str(path)!r} is an existing file, not a directory; choose another out=")
        if not os.access(path, os.W_OK | os.X_OK):
            raise UserError(f"out {str(path)!r} is not writable; choose another out=")
        return
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"out {str(path)!r} lies under {str(ancestor)!r}, which is a file; choose another out=")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"out {str(path)!r} cannot be created: {str(ancestor)!r} is not writable; choose another out=")


def make_out_dir(path: Path) -> None:
    check_out_dir(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"out {str(path)!r} cannot be created ({err.strerror}); choose another out=") from None


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold OUT/.lock for the duration; refuse if another live process holds it."""
    make_out_dir(path)
    handle = _acquire(path / LOCK)
    with handle:
        handle.write(f"PID {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
        remove_temp_files(path)
        try:
            yield
        finally:
            (path / LOCK).unlink(missing_ok=True)  # before unlocking: a waiter then sees a new file
            fcntl.flock(handle, fcntl.LOCK_UN)


def _acquire(lock: Path) -> TextIO:
    """The lock file, open and exclusively locked, emptied for the new holder's line."""
    while True:
        try:
            handle = open(lock, "a+")  # noqa: SIM115 (held open while locked)
        except OSError as err:
            raise UserError(
                f"out {str(lock.parent)!r} cannot be locked ({err.strerror}); choose another out="
            ) from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise UserError(
                f"out {str(lock.parent)!r} is in use by {holder}; wait for it to finish or choose another out="
            ) from None
        try:
            current = os.stat(lock).st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            handle.seek(0)
            handle.truncate()
            return handle
        handle.close()  # the previous holder removed this file while we waited for it: open the new one


def remove_temp_files(path: Path) -> None:
    """Temporary files of an atomic write that never finished (its writer was killed)."""
    for tmp in path.glob(TEMP_GLOB):
        tmp.unlink(missing_ok=True)


def clear(path: Path) -> None:
    """Remove everything a run or `evaluate` wrote into `path` (overwrite=true)."""
    for name in WRITTEN:
        target = path / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)
    remove_temp_files(path)


def stored_config(path: Path, action: str = "resume", advice: str = "use overwrite=true to start over") -> dict:
    """The settings a run in `path` was started with; UserError (saying what could not be done:
    `action`, and what to do: `advice`) if config.yaml is missing or unusable."""
    from splitlab.config import load_config_file, resolve_config

    file = path / "config.yaml"
    if not file.is_file():
        raise UserError(f"cannot {action} {str(path)!r}: its config.yaml is missing; {advice}")
    try:
        stored = load_config_file(file)
        if not stored:
            raise UserError("it is empty")
        resolve_config(stored)
    except UserError as err:
        raise UserError(f"cannot {action} {str(path)!r}: config.yaml is unusable ({err}); {advice}") from None
    return stored
