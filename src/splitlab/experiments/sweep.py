"""Running a sweep's grid (`splitlab.experiments.grid` reads and expands the file).

Every point is expanded and validated before the first run starts. Runs go in parallel worker
processes (`jobs`), or as Ray tasks over a cluster (`ray`, docs/ray.md); running a sweep again
skips runs that have a `summary.json` and resumes the others from their checkpoint. A failed run
leaves `error.txt` in its directory and its traceback in `failures.json`; the others go on, and
`SweepFailed` is raised at the end.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import yaml

from splitlab import cluster, rundir
from splitlab.errors import UserError
from splitlab.experiments.grid import (
    PRETRAIN,
    GridPoint,
    check_target,
    expand_points,
    expand_sweep,
    load_sweep,
    run_name,
)
from splitlab.io import write_text
from splitlab.plugins import ray_options
from splitlab.process_settings import set_worker_threads

__all__ = [
    "ERROR_FILE",
    "FAILURES",
    "SNAPSHOT",
    "SweepFailed",
    "available_cpus",
    "check_target",
    "expand_sweep",
    "load_sweep",
    "run_name",
    "run_sweep",
]

log = logging.getLogger(__name__)


SNAPSHOT = "sweep.yaml"  # copy of the expanded sweep, written into the sweep directory


FAILURES = "failures.json"  # name -> traceback of the runs that failed in the last sweep


ERROR_FILE = "error.txt"  # traceback of a failed run, inside its run directory


RAY_RETRIES = 3  # times a Ray task is started again after its worker process died

_RUN_CONTROL = ("out", "resume", "overwrite", "device")  # may differ between a run and its resume


class SweepFailed(RuntimeError):
    """Some runs of a sweep failed; the others finished. `failures` maps run name -> traceback."""

    def __init__(self, sweep_dir: Path, failures: dict[str, str], total: int):
        self.sweep_dir = Path(sweep_dir)
        self.failures = dict(failures)
        self.total = total
        names = ", ".join(sorted(failures)[:5]) + (", ..." if len(failures) > 5 else "")
        super().__init__(
            f"{len(failures)} of {total} runs failed ({names}); tracebacks in "
            f"{self.sweep_dir / FAILURES}; run the sweep again to retry them"
        )


def _normalize(value: Any) -> Any:
    """Compare configs as YAML would store them (tuples -> lists etc.)."""
    return yaml.safe_load(yaml.safe_dump(value))


def _check_existing(runs: list[GridPoint], sweep_dir: Path) -> None:
    """Refuse, before anything runs, to resume a run directory made with a different config."""
    for p in runs:
        name = p.name
        path = sweep_dir / name / "config.yaml"
        if not path.is_file():
            continue
        try:
            old = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (yaml.YAMLError, OSError):
            continue
        new = _normalize(p.resolved)
        for key in sorted(set(old) & set(new)):
            if key not in _RUN_CONTROL and old[key] != new[key]:
                raise UserError(
                    f"run {name} in {sweep_dir / name} was made with {key}={old[key]!r} but the sweep "
                    f"now gives {key}={new[key]!r}; delete that directory or use another --out"
                )


def _write_snapshot(sweep_dir: Path, spec: dict, source: str, runs: list[GridPoint]) -> None:
    snapshot = {
        "source": source,
        "description": spec.get("description"),
        "base": spec["base"],
        "axes": spec["axes"],
        "exclude": spec["exclude"],
        "overrides": spec["overrides"],
        "report": spec.get("report") or {},
        **({PRETRAIN: spec[PRETRAIN]} if spec.get(PRETRAIN) is not None else {}),
        "runs": {p.name: p.axis_values for p in runs},
    }
    snapshot = json.loads(json.dumps(snapshot, default=str))  # plain types only (Path -> str)
    write_text(sweep_dir / SNAPSHOT, yaml.safe_dump(snapshot, sort_keys=False, allow_unicode=True))


def _call_engine(config: dict, progress: bool) -> dict:
    from splitlab import (
        engine,  # looked up at call time so tests can monkeypatch engine.run
    )

    return engine.run(config, resume=True, progress=progress)


def available_cpus() -> int:
    """CPUs this process may run on (respects taskset / cgroup affinity, unlike os.cpu_count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


#: In a worker process: whether a run is in progress (what SIGTERM then interrupts).
_running = False
#: Seconds a stopped sweep waits for its workers to close their runs, before it kills them.
STOP_WAIT = 30


def _run_in_worker(name: str, config: dict) -> tuple[str, dict | None, str | None, float]:
    global _running
    start = time.perf_counter()
    _running = True
    try:
        summary = _call_engine(config, progress=False)
        return name, dict(summary) if summary is not None else {}, None, time.perf_counter() - start
    except Exception:  # a failing run must not take the others down
        return name, None, traceback.format_exc(), time.perf_counter() - start
    finally:
        _running = False


def _start_worker(threads: int) -> None:
    """A pool worker: Ctrl-C (which a terminal sends to every process of the group) is the parent's
    to handle; the parent's SIGTERM ends the run in progress as Ctrl-C ends a run (its files whole,
    its checkpoint kept, its lock removed), or an idle worker quietly."""
    set_worker_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop_worker)


def _stop_worker(signum: int, frame: object) -> None:
    if _running:
        raise KeyboardInterrupt
    raise SystemExit(0)


def _run_on_ray_worker(name: str, config_json: str, threads: int) -> str:
    """A sweep run as a Ray task: config in, summary out, both as JSON (nothing of splitlab's is pickled)."""
    set_worker_threads(threads)
    name, summary, error, seconds = _run_in_worker(name, json.loads(config_json))
    if error is not None:  # where it failed: a node may lack what the driver's machine has (a dataset)
        error = f"{error.rstrip()} [on {cluster.this_node()}]\n"  # on the line the sweep prints
    return json.dumps((name, summary, error, seconds))


def _run_on_ray(pending: list[tuple[str, dict]], resources: dict, finished: Callable[..., None]) -> None:
    """Every pending run as a Ray task; a task whose worker process dies is started again (up to
    `RAY_RETRIES` times) and resumes from its run's last checkpoint."""
    ray = cluster.ray_module()
    task = ray.remote(_run_on_ray_worker)
    threads = int(resources["num_cpus"])
    futures = {}
    for name, config in pending:  # each run's plugins travel with it
        options = {
            "max_retries": RAY_RETRIES,
            "retry_exceptions": False,
            **resources,
            **ray_options(config.get("plugins")),
        }
        futures[task.options(**options).remote(name, json.dumps(config), threads)] = name
    try:
        remaining = list(futures)
        while remaining:
            ready, remaining = ray.wait(remaining, num_returns=1)
            name = futures[ready[0]]
            try:
                finished(*json.loads(ray.get(ready[0])))
            except ray.exceptions.WorkerCrashedError:
                finished(name, None, f"Ray worker died {RAY_RETRIES + 1} times (killed, or out of memory?)\n", 0.0)
            except ray.exceptions.RayError:
                finished(name, None, traceback.format_exc(), 0.0)
    except BaseException:  # Ctrl-C: cancel the tasks (each run keeps its last checkpoint)
        log.warning(f"cancelling {_plural(len(futures), 'Ray task')}; each run resumes from its checkpoint")
        for future in futures:
            ray.cancel(future, force=True)
        raise


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _describe(summary: dict | None) -> str:
    if not summary:
        return "done"
    parts = []
    if isinstance(summary.get("final_accuracy"), (int, float)):
        parts.append(f"final acc {100 * summary['final_accuracy']:.2f}%")
    if isinstance(summary.get("total_gib"), (int, float)):
        parts.append(f"{summary['total_gib']:.4g} GiB")
    return ", ".join(parts) or "done"


def run_sweep(
    path: str | os.PathLike | Mapping,
    out: str | os.PathLike | None = None,
    jobs: int = 1,
    progress: bool = True,
    ray: str | None = None,
    cpus_per_run: int = 1,
    gpus_per_run: float = 0,
) -> Path:
    """Run every grid point of a sweep file that has not finished; return the sweep directory.

    Finished runs (with `summary.json`) are skipped; the others are started, or resumed from
    their checkpoint, with `engine.run(config, resume=True)`. With `jobs > 1` runs go to
    `jobs` spawned processes, each limited to `available_cpus() // jobs` torch threads (fewer
    workers if fewer runs are left; then each gets more threads). A run that
    raises is recorded (`<run dir>/error.txt`, `<sweep dir>/failures.json`) and the others go
    on; at the end `SweepFailed` is raised if any failed.

    With `ray` (an address, or "auto"), every run is a Ray task with `cpus_per_run` CPUs (its
    torch threads) and `gpus_per_run` GPUs; a task whose worker dies is retried, and resumes from
    its run's checkpoint. The sweep directory must be on storage every Ray node shares (checked).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise UserError(f"--jobs must be an integer >= 1, got {jobs!r}")
    on_ray = None if ray is None else cluster.resources(cpus_per_run, gpus_per_run)
    spec, stem = load_sweep(path)
    where = stem if isinstance(path, Mapping) else str(path)
    sweep_dir = Path(out) if out is not None else Path("runs") / stem
    if ray is not None:
        sweep_dir = sweep_dir.absolute()  # the runs' `out`, the same path on every node
    runs = expand_points(spec, where, sweep_dir)
    _check_existing(runs, sweep_dir)
    if ray is None:  # on Ray, the data may be only where the tasks run
        _check_runs(runs, where)

    if ray is not None and on_ray is not None:  # before the lock: an unreachable cluster leaves nothing behind
        cluster.connect(ray)
        cluster.check_fits(on_ray)
    with rundir.locked(sweep_dir):  # a second sweep into the same directory is refused, naming the holder
        if on_ray is not None:
            cluster.check_shared_storage(sweep_dir)
        try:
            return _run_points(spec, where, sweep_dir, runs, jobs, progress, on_ray)
        except KeyboardInterrupt:  # what the CLI says, in one line
            done = sum((sweep_dir / point.name / "summary.json").is_file() for point in runs)
            raise KeyboardInterrupt(
                f"{done} of {len(runs)} runs finished in {str(sweep_dir)!r}; to continue, run the same sweep "
                f"command again (each unfinished run resumes from its last checkpoint)"
            ) from None


def _check_runs(runs: list[GridPoint], where: str) -> None:
    """Every run's config as its run would check it (dataset, cut, subsets, ...), before the first starts."""
    from splitlab.build import check

    # the pretraining run's model, each run's init, is not made yet; lora, which fine-tunes it, is
    # checked when the run starts
    pretrained = any(point.name == PRETRAIN for point in runs)
    for point in runs:
        config = {k: v for k, v in point.config.items() if not (pretrained and k in ("init", "lora", "lora_targets"))}
        try:
            check(config)
        except UserError as error:
            raise UserError(f"{where}: run {point.name}: {error}") from None


def _run_points(
    spec: dict, where: str, sweep_dir: Path, runs: list, jobs: int, progress: bool, on_ray: dict | None
) -> Path:
    sweep_dir.mkdir(parents=True, exist_ok=True)
    _write_snapshot(sweep_dir, spec, where, runs)
    # seed-major order, so that an interrupted sweep has every configuration's first seeds
    seed_axis = spec["axes"].get("seed")
    order = {
        p.name: (seed_axis.index(p.axis_values["seed"]) if seed_axis and p.name != PRETRAIN else -1, i)
        for i, p in enumerate(runs)
    }
    pending = sorted(
        ((p.name, p.config) for p in runs if not (sweep_dir / p.name / "summary.json").is_file()),
        key=lambda nc: order[nc[0]],
    )
    total, skipped, to_run = len(runs), len(runs) - len(pending), len(pending)

    if progress:
        log.info(
            f"sweep {where}: {total} runs in {sweep_dir}"
            + (f", {skipped} already finished" if skipped else "")
            + (f", {len(pending)} to run " if pending else "")
            + (("on Ray" if on_ray else f"with {_plural(min(jobs, len(pending)), 'job')}") if pending else "")
        )

    failures: dict[str, str] = {}
    done = 0

    def finished(name: str, summary: dict | None, error: str | None, seconds: float) -> None:
        nonlocal done
        done += 1
        if error is not None:
            failures[name] = error
            try:
                (sweep_dir / name).mkdir(parents=True, exist_ok=True)
                write_text(sweep_dir / name / ERROR_FILE, error)
            except OSError:
                pass
            last = error.strip().splitlines()[-1] if error.strip() else "error"
            log.error(f"[{done}/{to_run}] FAILED {name}: {last}")
        elif progress:
            log.info(f"[{done}/{to_run}] {name}: {_describe(summary)} ({seconds:.1f} s)")

    for name, _ in pending:  # a retried run is no longer failed
        (sweep_dir / name / ERROR_FILE).unlink(missing_ok=True)

    if pending and pending[0][0] == PRETRAIN:  # the others start from its model: it runs first, here
        name, config = pending.pop(0)
        start = time.perf_counter()
        try:
            finished(name, _call_engine(config, progress=progress), None, time.perf_counter() - start)
        except Exception:
            finished(name, None, traceback.format_exc(), time.perf_counter() - start)
            write_text(sweep_dir / FAILURES, json.dumps(failures, indent=2))
            raise SweepFailed(sweep_dir, failures, total) from None

    workers = min(jobs, len(pending))
    if on_ray is not None:
        _run_on_ray(pending, on_ray, finished)
    elif workers <= 1:
        for name, config in pending:
            start = time.perf_counter()
            try:
                summary = _call_engine(config, progress=progress)
                finished(name, summary, None, time.perf_counter() - start)
            except Exception:
                finished(name, None, traceback.format_exc(), time.perf_counter() - start)
    elif pending:
        threads = max(1, available_cpus() // workers)
        ctx = multiprocessing.get_context("spawn")
        pool = cf.ProcessPoolExecutor(
            max_workers=workers, mp_context=ctx, initializer=_start_worker, initargs=(threads,)
        )
        try:
            futures = {pool.submit(_run_in_worker, n, c): n for n, c in pending}
            for fut in cf.as_completed(futures):
                name = futures[fut]
                try:
                    finished(*fut.result())
                except BrokenProcessPool:
                    finished(name, None, "worker process died (killed, or out of memory?)\n", 0.0)
                except Exception:
                    finished(name, None, traceback.format_exc(), 0.0)
        except BaseException:  # Ctrl-C: stop the workers' runs now (each keeps its last checkpoint)
            running = multiprocessing.active_children()
            pool.shutdown(wait=False, cancel_futures=True)
            for process in running:
                process.terminate()
            for process in running:  # each closes its run's files within seconds
                process.join(STOP_WAIT)
                if process.is_alive():
                    process.kill()
            raise
        pool.shutdown(wait=True)

    failures_path = sweep_dir / FAILURES
    if failures:
        write_text(failures_path, json.dumps(failures, indent=2))
        raise SweepFailed(sweep_dir, failures, total)
    failures_path.unlink(missing_ok=True)
    if progress:
        log.info(f"sweep {where}: all {total} runs finished in {sweep_dir}")
    return sweep_dir
