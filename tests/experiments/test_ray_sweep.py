"""Sweeps on a real local Ray (the Ray tests' `local_ray`, tests/conftest.py: 4 CPUs): the numbers of
a sweep in process, with a killed worker's run retried from its checkpoint, and run directories
must be on storage every node sees."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from test_sweep import BASE, numbers, write_sweep

from helpers import held_plugin
from splitlab import cluster
from splitlab.errors import UserError
from splitlab.experiments import run_sweep, sweep, write_report
from splitlab.rundir import CHECKPOINT

SPEC = {"base": {**BASE, "rounds": 8}, "axes": {"algorithm": ["sfl_v1", "sfl_v2"], "seed": [0, 1]}}


@pytest.fixture(scope="module")
def held(tmp_path_factory) -> Iterator[tuple[Path, list[Path]]]:
    """A sweep of two runs, 3 rounds each, of two plugins' copies of SFL-V1 and SFL-V2 that wait before round 1
    while their files exist (`held_plugin`): a run on Ray has checkpointed and is still running when
    the test kills it, however loaded the machine. The sweep file and those files (removed)."""
    folder = tmp_path_factory.mktemp("held")
    plugins = [held_plugin(folder, algorithm) for algorithm in ("sfl_v1", "sfl_v2")]
    sys.path.insert(0, str(folder))
    holds = [hold for _, hold in plugins]
    for hold in holds:
        hold.unlink()
    names = [keys["algorithm"] for keys, _ in plugins]
    base = {**BASE, "rounds": 3, "plugins": ",".join(names)}
    yield write_sweep(folder, {"base": base, "axes": {"algorithm": names}}), holds
    sys.path.remove(str(folder))


def test_a_sweep_on_ray_with_a_worker_killed_gives_the_numbers_of_jobs(local_ray, held, tmp_path: Path):
    """SIGKILL the Ray worker process of a run that has checkpointed but not finished (its PID is in
    the run directory's lock file): Ray starts the task again, the run resumes, and every number
    ends as in the sweep in this process (jobs=1, one torch thread as each Ray task: torch's CPU
    kernels may split sums differently with more threads; --jobs 2 gives these numbers too:
    tests/experiments/test_sweep.py)."""
    path, holds = held
    reference = run_sweep(path, out=tmp_path / "jobs", jobs=1, progress=False)
    write_report(reference)
    for hold in holds:
        hold.touch()
    out = tmp_path / "killed"
    sweep = threading.Thread(target=run_sweep, args=(path,), kwargs={"out": out, "ray": "auto", "progress": False})
    sweep.start()
    killed = None
    while killed is None and sweep.is_alive():
        for run in out.glob("*/"):
            lock = run / ".lock"
            if (run / CHECKPOINT).exists() and not (run / "summary.json").exists() and lock.exists():
                holder = lock.read_text().split()
                if holder[:1] == ["PID"]:
                    os.kill(int(holder[1]), signal.SIGKILL)
                    killed = run.name
                    break
        time.sleep(0.05)
    for hold in holds:
        hold.unlink()
    sweep.join()
    assert killed is not None, "no run was caught between its first checkpoint and its end"
    assert all((run / "summary.json").exists() for run in out.glob("*=*"))
    write_report(out)
    assert numbers(out) == numbers(reference)


def test_storage_a_node_does_not_see_is_refused(local_ray, tmp_path: Path, monkeypatch):
    """Locally every node sees the directory; a node that reads another token at the same path (as a
    machine with its own disk would) is named in a one-line refusal, before any run starts."""
    probe = tmp_path / "probe"
    probe.write_text("this machine's token")
    assert cluster.nodes_not_seeing(probe, "this machine's token") == []
    elsewhere = cluster.nodes_not_seeing(probe, "another machine's token")
    assert elsewhere == [node["NodeManagerAddress"] for node in ray.nodes() if node["Alive"]]
    cluster.check_shared_storage(tmp_path / "shared")  # local Ray: shared
    assert not (tmp_path / "shared" / cluster.PROBE).exists()

    monkeypatch.setattr(cluster, "nodes_not_seeing", lambda path, token: ["10.0.0.7"])
    path = write_sweep(tmp_path, SPEC)
    with pytest.raises(UserError, match=r"not on storage every Ray node shares \(Ray node\(s\) 10\.0\.0\.7"):
        run_sweep(path, out=tmp_path / "out", ray="auto", progress=False)
    assert not list((tmp_path / "out").glob("*=*"))


def test_a_run_bigger_than_every_node_is_refused(local_ray, tmp_path: Path):
    """Ray would wait for ever for a node with 5 CPUs; the sweep says so in one line instead."""
    path = write_sweep(tmp_path, SPEC)
    with pytest.raises(UserError, match=r"--cpus-per-run 5 --gpus-per-run 0 fits no Ray node \(the largest has 4 CPUs"):
        run_sweep(path, out=tmp_path / "o", ray="auto", cpus_per_run=5)


def test_bad_resources_are_refused(tmp_path: Path):
    path = write_sweep(tmp_path, SPEC)
    with pytest.raises(UserError, match="--cpus-per-run must be an integer >= 1, got 0"):
        run_sweep(path, out=tmp_path / "o", ray="auto", cpus_per_run=0)
    with pytest.raises(UserError, match="--gpus-per-run must be a number >= 0, got -1"):
        run_sweep(path, out=tmp_path / "o", ray="auto", gpus_per_run=-1)


def test_a_run_that_fails_on_a_node_names_the_node(local_ray, tmp_path: Path):
    """A node without the dataset: the run's error ends with the node's id and hostname, on the line
    the sweep prints (the paths it names are where that node looked)."""
    spec = {"base": {**BASE, "dataset": "cifar10", "data_dir": str(tmp_path / "nowhere")}, "axes": {"seed": [0]}}
    with pytest.raises(sweep.SweepFailed):
        run_sweep(write_sweep(tmp_path, spec), out=tmp_path / "o", ray="auto", progress=False)
    (error,) = [path.read_text() for path in (tmp_path / "o").glob("*/error.txt")]
    last = error.strip().splitlines()[-1]
    node = f"[on Ray node {ray.get_runtime_context().get_node_id()} ({socket.gethostname()})]"
    assert f"cifar10 file {tmp_path / 'nowhere'}" in last and last.endswith(node)
