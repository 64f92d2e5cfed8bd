"""Checkpoints: what a run resumed after a kill needs to end bit for bit where an uninterrupted one would.

A checkpoint holds every role's state that outlives a round (fetched through the transport), the
ledger's and the noise secret of the parties played here. It is encoded in the loop (a snapshot)
and written to disk in the background, every `checkpoint_every` seconds (`Checkpointer`);
`restore` loads it into a freshly built experiment.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from splitlab import codec
from splitlab.assembly import Experiment
from splitlab.errors import UserError
from splitlab.io import write_safetensors
from splitlab.rundir import CHECKPOINT


def role_states(experiment: Experiment) -> dict[str, Any]:
    """Every role's state that outlives a round (fetched through the transport), the ledger's,
    and the noise secret of the parties played here (kept with their state, never elsewhere)."""
    algorithm, ledger = experiment.algorithm, experiment.ledger
    secret = experiment.blueprint.noise_secret
    return {
        **({"noise_secret": torch.tensor(list(secret), dtype=torch.uint8)} if secret is not None else {}),
        "algorithm": algorithm.state_dict(),
        "server": algorithm.server.state_dict(),
        "sync": algorithm.sync.state_dict(),
        "clients": algorithm.client_states(),
        "ledger": {
            "bytes_by_kind": ledger.state_dict(),
            "bytes_by_client": {str(k): n for k, n in ledger.bytes_by_client.items()},
            "envelope_bytes": ledger.envelope_bytes,
            "wire_bytes": ledger.wire_bytes,
        },
    }


def restore(experiment: Experiment, state: dict[str, Any]) -> None:
    """Load `role_states` into a freshly built experiment."""
    algorithm, ledger = experiment.algorithm, experiment.ledger
    if "noise_secret" in state:
        experiment.transport.install_noise_secret(experiment.blueprint, bytes(state["noise_secret"].tolist()))
    algorithm.load_state_dict(state["algorithm"])
    algorithm.server.load_state_dict(state["server"])
    algorithm.sync.load_state_dict(state["sync"])
    algorithm.load_client_states(state["clients"])
    ledger.bytes_by_kind = dict(state["ledger"]["bytes_by_kind"])
    ledger.bytes_by_client = {int(k): int(n) for k, n in state["ledger"].get("bytes_by_client", {}).items()}
    ledger.envelope_bytes = int(state["ledger"]["envelope_bytes"])
    ledger.wire_bytes = int(state["ledger"].get("wire_bytes", 0))


SNAPSHOT_SHARE = 0.02
"""The most of a run's time that taking checkpoint snapshots may hold up training (checkpoint_every > 0)."""


class Checkpointer:
    """Snapshots of every role's state, copied in the loop and written to disk in the background.

    A snapshot is one copy of the tensors, streamed from its memory to the file while training
    goes on (building the file's bytes in memory first took twice the memory and, for FSL-SAGE's
    1.2 GB state, 8 s of page faults); one write at a time, and a snapshot waits for the previous
    write. A snapshot is taken when `every` seconds have passed since the last one (0: after
    every round), and never sooner than its in-loop cost allows: a snapshot that held the loop for
    s seconds is followed by at least s / SNAPSHOT_SHARE seconds of training, so large states
    (FSL-SAGE's aux models and buffers) cost the same share."""

    def __init__(self, experiment: Experiment) -> None:
        self.experiment = experiment
        self.path = experiment.out / CHECKPOINT
        self.every = experiment.config.run.checkpoint_every
        self._last = time.monotonic()
        self._interval = self.every
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def load(self) -> dict[str, Any] | None:
        """The loop state of the last checkpoint, with every role restored; None if there is none."""
        if not self.path.exists():
            return None
        try:
            state = codec.decode(self.path.read_bytes(), self.experiment.blueprint.device)
            restore(self.experiment, state)
        except (codec.MessageError, KeyError, TypeError, ValueError, RuntimeError) as error:
            raise UserError(
                f"cannot resume from {str(self.path)!r}: the checkpoint is unreadable "
                f"({str(error).splitlines()[0][:120]}); use overwrite=true to start over"
            ) from None
        return state["loop"]

    def maybe_save(self, loop: dict[str, Any], force: bool = False) -> None:
        if not force and time.monotonic() - self._last < self._interval:
            return
        started = time.monotonic()
        snapshot = codec.flatten({"loop": loop, **role_states(self.experiment)}, copy=True)
        self.wait()
        self._writer = threading.Thread(target=self._write, args=snapshot, daemon=True)
        self._writer.start()
        self._last = time.monotonic()
        if self.every:
            self._interval = max(self.every, (self._last - started) / SNAPSHOT_SHARE)

    def _write(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
        try:
            write_safetensors(self.path, tensors, metadata)
        except BaseException as error:  # surfaced by wait(), in the loop's thread
            self._error = error

    def wait(self) -> None:
        """Wait for the write in progress; raise its error, if it failed."""
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    @contextlib.contextmanager
    def kept_on_failure(self, loop: dict[str, Any]) -> Iterator[None]:
        """The work after the last round (final files, exports, eval_generate): if it fails or is
        interrupted (Ctrl-C in a long generation), the trained roles are checkpointed first, where
        they still can be, so that `resume=true` (with other eval_* keys, say) finishes the run from
        them rather than training it again."""
        try:
            yield
        except (Exception, KeyboardInterrupt):
            with contextlib.suppress(Exception):  # the roles are gone too: the failure is what to say
                self.maybe_save(loop, force=True)
                self.wait()
            raise

    def again(self) -> str:
        """How to go on after the run stops here: resume=true from a checkpoint written (or being
        written), else the same command (a run stopped before its first one leaves nothing)."""
        if self._writer is not None or self.path.exists():
            return "add resume=true"
        return "run the same command again (no checkpoint was kept)"

    def join(self) -> None:
        """Wait for the write in progress (also when the loop stops on an error: a started
        checkpoint is finished, never left half-written or lost)."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None

    def remove(self) -> None:
        self.wait()
        self.path.unlink(missing_ok=True)
