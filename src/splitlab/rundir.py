"""A run directory: the files it holds, and the rules for starting, resuming or replacing them
(usable before any work, one writer at a time, nothing stale), in one place for the engine,
sweeps, reports and the CLI (no torch import).

- `RUN_FILES` names the files of a run, `CHECKPOINT` among them; `RunDirectory.started` decides,
  from those present, whether a run starts, is resumed (with the settings it was started with) or
  is already finished; and a run started afresh that fails before its first round has trained
  (and before its first checkpoint), whatever stopped it, leaves nothing of its own behind (the
  corrected command starts afresh there); once a round has trained, a failure removes nothing.

- `check_out_dir` refuses an out= that can never become a directory (an existing file, a path
  under a file, a place nobody can write) before data is loaded or anything is written.
- `locked` holds an exclusive lock on OUT/.lock (fcntl.flock, released by the kernel when its
  process dies, so a dead run's lock is simply taken over; the file is removed when the run ends).
  A second process is refused with one line naming the holder's PID and host. While holding it,
  what a killed atomic write left is recovered (`splitlab.io.recover`: temporary files and folders
  removed, an export renamed aside put back where its replacement never arrived).
- `WRITTEN` is every file a run or `evaluate` writes, for `overwrite=true` to remove.
- `kept_after_interruption` says, from the files alone, what an interrupted run kept and what
  `resume=true` will do with it (the CLI's last line after Ctrl-C or SIGTERM).
- `file_errors` is the one place where an OS error on a command's files (a full disk, a read-only
  or forbidden place, a file where a folder should be) becomes one line, `FilesError`: the path,
  the cause and what was kept; exit code 1.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from splitlab import io
from splitlab.errors import UserError
from splitlab.logs import LOGGER

if TYPE_CHECKING:
    from splitlab.config import ResolvedConfig

CHECKPOINT = "checkpoint.safetensors"
DECODING = "decoding.json"  # a language run's (splitlab.run_weights.decoding_record)
RUN_FILES = (
    "config.yaml",
    "partition.json",
    DECODING,
    "metrics.jsonl",
    "summary.json",
    CHECKPOINT,
    "weights.safetensors",
    "clients.safetensors",
)
#: A finished run's curves, drawn by `splitlab run` (splitlab.experiments.plots.plot_run).
CURVES = "curves.png"
LOCK = ".lock"
#: Every file or folder a run (engine, its trackers) or `splitlab evaluate` writes into its directory.
WRITTEN = (
    *RUN_FILES,
    "metrics.csv",
    CURVES,
    "evaluation.json",
    "tensorboard",
    "mlruns",
    "wandb",
    "record",
    "attack.json",
    "attack_inversion.png",
    "attack_unsplit.png",
    "attack_fsha.png",
    "hf",
    "peft",
    "checkpoints",
    "steps.jsonl",
    "generations.jsonl",
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
        io.recover(path)
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


def clear(path: Path, names: Sequence[str] = WRITTEN) -> None:
    """Remove everything a run or `evaluate` wrote into `path` (overwrite=true), or the files `names`."""
    io.recover(path)
    for name in names:
        io.remove(path / name)


def check_resume_target(path: Path) -> None:
    """resume=true needs a run to continue: a directory without one is refused (not started afresh)."""
    if not any((path / name).exists() for name in RUN_FILES):
        raise UserError(f"cannot resume {str(path)!r}: it holds no run; leave out resume=true to start one there")


def stored_config(path: Path, action: str = "resume", advice: str = "use overwrite=true to start over") -> dict:
    """The settings a run in `path` was started with; UserError (saying what could not be done:
    `action`, and what to do: `advice`) if config.yaml is missing or unusable."""
    from splitlab.config import load_config_file
    from splitlab.resolve import resolve_config

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


def checkpoint_round(path: Path) -> int | None:
    """The rounds finished when the checkpoint in run directory `path` was taken (None: there is none
    or it is unreadable), read from its header alone."""
    from safetensors import safe_open

    from splitlab.codec import SKELETON

    try:
        with safe_open(str(path / CHECKPOINT), "pt") as file:
            return int(json.loads(file.metadata()[SKELETON])["loop"]["round"])
    except Exception:  # noqa: BLE001 (missing, damaged or foreign: no usable checkpoint)
        return None


def _stored_rounds(path: Path) -> int | None:
    """The rounds the run in `path` was started for (None: its config.yaml is missing or unusable)."""
    from splitlab.config import load_config_file

    try:
        return int(load_config_file(path / "config.yaml")["rounds"])
    except Exception:  # noqa: BLE001 (missing or damaged: not known)
        return None


def kept_after_interruption(path: Path) -> str:
    """What an interrupted (or failed) run left in `path`, and what `resume=true` will do with it."""
    if (path / "summary.json").is_file():
        return f"the run in {str(path)!r} had finished; its files are complete"
    done = checkpoint_round(path)
    if done is not None and done == _stored_rounds(path):
        return (
            f"kept: the checkpoint after the last round, {done}, in {str(path)!r}; add resume=true to finish "
            f"the run from it (no round is trained again)"
        )
    if done is not None:
        return (
            f"kept: the checkpoint after round {done} in {str(path)!r}; add resume=true to continue from round "
            f"{done + 1} (rounds after it are replayed, with the same results)"
        )
    if (path / "config.yaml").is_file():
        return (
            f"nothing to continue from was saved in {str(path)!r} (no checkpoint yet: one is taken every "
            f"checkpoint_every seconds, 0 = every round); resume=true will start again at round 1, as will "
            f"the same command"
        )
    return f"nothing of the run was kept in {str(path)!r} (no checkpoint yet); run the same command again"


class FilesError(UserError):
    """The files of a command could not be written or read (an OSError the user can fix: space,
    permissions, a file in the way); nothing already written is lost."""

    exit_code = 1


#: OS errors about a place on disk that the user can fix, as opposed to a bug
FILE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR, errno.EDQUOT}
    | {errno.ENAMETOOLONG, errno.EEXIST, errno.ENOENT, errno.EIO, errno.EMFILE, errno.ENFILE, errno.EFBIG}
)


@contextlib.contextmanager
def file_errors(where: Path | str, kept: Callable[[], str] | None = None) -> Iterator[None]:
    """Turn an OSError on `where`'s files into one line: the file, the cause, and `kept()` (what is
    still there). Other OS errors (not about a place on disk) keep their traceback."""
    try:
        yield
    except OSError as error:
        if error.errno not in FILE_ERRNOS:
            raise
        raise FilesError(describe_file_error(error, where, kept)) from None


def describe_file_error(error: OSError, where: Path | str, kept: Callable[[], str] | None = None) -> str:
    name = error.filename or where
    cause = error.strerror or os.strerror(error.errno or 0)
    note = kept() if kept is not None else "files written before it are complete"
    return f"cannot write {str(name)!r}: {cause}; {note}"


class RunDirectory:
    """The run's files, and the rules for starting, resuming or replacing them."""

    def __init__(self, config: ResolvedConfig) -> None:
        self.path = config.out_dir
        self.config = config
        #: set by the engine once round 1 has trained: from then on a failure removes nothing
        self.trained = False

    def existing(self) -> list[str]:
        return [name for name in RUN_FILES if (self.path / name).exists()]

    @contextlib.contextmanager
    def started(self, resume: bool, overwrite: bool) -> Iterator[dict[str, Any] | None]:
        """Hold the directory's lock and start a run there (replacing one with overwrite=true, or
        one that stopped before its first checkpoint: nothing to continue from) or resume the one
        there; yields the summary of a run already finished (nothing to do), else None while the
        run goes on. A run started afresh that fails before its first round has trained and before
        its first checkpoint (any exception but Ctrl-C, which keeps what it wrote for `resume=true`
        to start again) removes what it wrote, and the directory if it made it: the same command,
        corrected, starts afresh there. Once a round has trained, nothing is removed. A resumed
        run's files stay as they were; the evaluation keys it changed are recorded in config.yaml."""
        made = not self.path.exists()
        undone = False
        try:
            with locked(self.path):
                existing = self.existing()
                stopped_early = not {CHECKPOINT, "summary.json"} & set(existing)
                if existing and stopped_early and not overwrite and not resume:
                    LOGGER.info(f"replacing the run in {str(self.path)!r}: it stopped before its first checkpoint")
                    overwrite = True
                if existing and not overwrite and not resume:
                    raise UserError(
                        f"out {str(self.path)!r} already holds a run; use resume=true to continue it "
                        f"or overwrite=true to replace it"
                    )
                if existing and not overwrite:
                    changed = self.check_resumable()
                    if "summary.json" in existing:
                        yield self.summary()
                        return
                    self.record_evaluation_keys(changed)
                    if CHECKPOINT not in existing:
                        LOGGER.info(f"{str(self.path)!r} holds no checkpoint: starting again at round 1")
                    yield None
                    return
                if existing:
                    self.clear()
                there = {name for name in WRITTEN if (self.path / name).exists()}  # not this run's
                try:
                    yield None
                except Exception:
                    undone = not self.trained and not (self.path / CHECKPOINT).exists()
                    if undone:
                        clear(self.path, [name for name in WRITTEN if name not in there])
                    raise
        finally:
            if made and undone:
                with contextlib.suppress(OSError):
                    self.path.rmdir()  # only if empty: nothing but this run's files was there

    def check_resumable(self) -> dict[str, Any]:
        """UserError if a key that decides what the run computes differs from the stored one; the
        evaluation keys (`eval_*`) that differ, with their new values (they may)."""
        from splitlab.config import EVALUATION_KEYS, RUN_CONTROL_KEYS

        # A key the stored config lacks (added to splitlab after the run began) counts as its default.
        # A model's key stored as null (a run from before models owned their keys) counts as its default too.
        model_keys = type(self.config.model_params).model_fields
        given = {k: v for k, v in stored_config(self.path).items() if not (v is None and k in model_keys)}
        stored = {**self.config.defaults(), **given}
        current = self.config.as_dict()
        differing = sorted(k for k in current if k not in RUN_CONTROL_KEYS and stored.get(k) != current[k])
        fixed = [key for key in differing if key not in EVALUATION_KEYS]
        if fixed:
            key = fixed[0]
            raise UserError(
                f"cannot resume {str(self.path)!r}: {key}={current[key]!r} differs from the "
                f"stored {stored.get(key)!r}; use overwrite=true to start over"
            )
        return {key: current[key] for key in differing}

    def record_evaluation_keys(self, changed: dict[str, Any]) -> None:
        """config.yaml with the evaluation keys a resumed run changed: it says how the summary was made."""
        from splitlab.config import load_config_file

        if changed:
            LOGGER.info(f"resuming with {', '.join(f'{k}={v!r}' for k, v in changed.items())} (evaluation only)")
            io.write_yaml(self.path / "config.yaml", {**load_config_file(self.path / "config.yaml"), **changed})

    def clear(self) -> None:
        clear(self.path)

    def summary(self) -> dict[str, Any]:
        """The summary of the finished run here; UserError if summary.json is unreadable."""
        from splitlab.json_text import file_json

        file = self.path / "summary.json"
        try:
            summary = file_json(file.read_text())
            if not isinstance(summary, dict) or "final_accuracy" not in summary:
                raise ValueError("not a run's summary")
        except (ValueError, UnicodeDecodeError) as error:
            raise UserError(
                f"cannot resume {str(self.path)!r}: its summary.json is unreadable ({str(error)[:80]}); "
                f"use overwrite=true to run it again"
            ) from None
        return summary
