"""The way in to one run: `run(config)` builds it (splitlab.build), starts or resumes its run
directory (splitlab.rundir) and runs the rounds (splitlab.loop), building the roles again when a
process holding some is lost; `serve` does the same with the client nodes reached over the network
(`splitlab server`).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from pydantic import BaseModel

from splitlab import rundir
from splitlab.assembly import Experiment
from splitlab.build import build
from splitlab.callbacks import Callback
from splitlab.config import RunConfig, flat_settings
from splitlab.errors import RoleLost, RoundFailed, UserError
from splitlab.ledger import Ledger
from splitlab.logs import LOGGER
from splitlab.loop import run_rounds
from splitlab.process_settings import prepare_process
from splitlab.rundir import RunDirectory
from splitlab.transport import Transport

if TYPE_CHECKING:
    from splitlab.net.server import ServerSettings


def run(
    config: RunConfig | Mapping[str, Any],
    *params: BaseModel,
    resume: bool | None = None,
    progress: bool = True,
    transport: Callable[[Ledger, torch.device], Transport] | None = None,
    callbacks: Sequence[Callback] = (),
) -> dict[str, Any]:
    """Run (or resume) one experiment; returns the summary that is also written to summary.json.
    `config`: a RunConfig or a mapping of KEY: VALUE settings; `params`: the algorithm's and the
    model's own settings as their params models (splitlab.config.flat_settings).
    `transport`: as for `build` (splitlab.net's server passes its network transport);
    `callbacks`: hooks of your own into the loop, called after splitlab's (splitlab.callbacks).

    When a process holding roles is lost (backend=ray: an actor or its node died), the roles are
    built again (in the actors still alive, and in new ones in place of those lost) and the run
    replays from its last checkpoint (from the start if it has none yet),
    as a resumed run would: bit for bit the same results. After `max_restarts` such losses, or when
    the roles cannot be built again (the nodes left lack the CPUs), the run stops with one line
    and the resume hint. The caller's global random states (torch's, numpy's, Python's), which
    the loop reseeds each round, are as they were when it returns."""
    with _callers_random_state():
        return _run_with_restarts(config, params, resume, progress, transport, callbacks)


@contextlib.contextmanager
def _callers_random_state() -> Iterator[None]:
    """Put back the global random states as they were (CUDA's where it had started)."""
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _run_with_restarts(
    config: RunConfig | Mapping[str, Any],
    params: tuple[BaseModel, ...],
    resume: bool | None,
    progress: bool,
    transport: Callable[[Ledger, torch.device], Transport] | None,
    callbacks: Sequence[Callback],
) -> dict[str, Any]:
    prepare_process()
    config = flat_settings(config, *params)
    experiment = build(config, transport)
    limit = experiment.config.run.max_restarts
    restarts, spare = 0, []
    while True:
        try:
            with contextlib.closing(experiment.transport):
                try:
                    return _run(experiment, resume, progress, callbacks)
                except RoleLost:
                    # the actors still alive are rebuilt in place of starting them again (backend=ray)
                    spare = experiment.transport.hand_over() if restarts < limit else []
                    raise
        except RoleLost as lost:
            restarts += 1
            resume = bool(RunDirectory(experiment.config).existing())  # lost before its first checkpoint: nothing kept
            again = "with resume=true to go on from its last checkpoint" if resume else "(no checkpoint was kept)"
            if restarts > limit:
                stopped = f"stopped after max_restarts={limit} restarts"
                raise RoundFailed(f"{lost}; {stopped}: run it again {again}") from None
            LOGGER.warning(
                f"{lost}: building the roles again and replaying from the last checkpoint "
                f"(restart {restarts} of at most {limit})"
            )
            try:
                again_config = {**config, "resume": True, "overwrite": False} if resume else config
                experiment = build(again_config, transport, spare=spare)
            except UserError as refused:  # what is left of the cluster cannot hold the roles (fewer CPUs)
                raise RoundFailed(
                    f"{lost}; the roles could not be built again: {refused}; then run it again with resume=true "
                    f"to go on from its last checkpoint"
                ) from None


def serve(raw: Mapping[str, Any], settings: ServerSettings, progress: bool = True) -> dict[str, Any]:
    """`splitlab server`: run the experiment `raw` configures with its client nodes in other
    processes, connecting over the network (splitlab.net.server's hub and transport)."""
    from splitlab.net.server import AuditLog, Hub, NetworkTransport, client_config
    from splitlab.resolve import resolve_config

    raw = {"checkpoint_every": 0, **raw}  # a networked server checkpoints every round unless told otherwise
    config = resolve_config(raw)
    out = config.out_dir
    rundir.check_out_dir(out)
    hub = Hub(settings, client_config(raw), AuditLog(out / "connections.jsonl"))
    hub.start()
    try:
        return run(raw, progress=progress, transport=lambda ledger, device: NetworkTransport(ledger, device, hub))
    finally:
        hub.close()


def _run(
    experiment: Experiment, resume: bool | None, progress: bool, callbacks: Sequence[Callback] = ()
) -> dict[str, Any]:
    run_config = experiment.config.run
    resume = run_config.resume if resume is None else resume
    directory = RunDirectory(experiment.config)
    kept = lambda: rundir.kept_after_interruption(directory.path)  # noqa: E731
    try:
        with rundir.file_errors(directory.path, kept), directory.started(resume, run_config.overwrite) as finished:
            if finished is not None:
                return finished
            return run_rounds(experiment, progress, [*callbacks, _Trained(directory)])
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the CLI says what was kept
        raise KeyboardInterrupt(kept()) from None


class _Trained(Callback):
    """Tells the run directory once a round has trained: from then on, a failure removes nothing."""

    def __init__(self, directory: RunDirectory) -> None:
        self.directory = directory

    def on_round_trained(self, state: dict[str, Any]) -> None:
        self.directory.trained = True
