"""backend=ray on a real local Ray (one per module): client nodes on worker actors, the training
server on its own, every message as codec bytes; bit for bit the in-process run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch

from helpers import crash_before_round, quick
from splitlab.engine import run
from splitlab.errors import UserError

TIMING = ("wall_seconds", "round_compute_seconds", "envelope_bytes")


@pytest.fixture(scope="module")
def local_ray():
    """Ray with 2 client workers + the server; the in-process runs with one torch thread, as each
    actor computes (torch's CPU kernels may split sums differently with more threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
    torch.set_num_threads(threads)


def results(out: Path) -> tuple[list[dict], bytes]:
    """metrics.jsonl without wall times and envelope bytes, and weights.safetensors as bytes."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows], (
        out / "weights.safetensors"
    ).read_bytes()


def config(algorithm: str, out: Path, **overrides) -> dict:
    extra = {"align_interval": 1} if algorithm == "fsl_sage" else {}
    return quick(algorithm=algorithm, clients=4, rounds=2, checkpoint_every=0, out=str(out), **extra, **overrides)


@pytest.mark.parametrize("algorithm", ["fedavg", "sfl_v1", "sfl_v2"])
def test_ray_backend_is_bit_identical_to_in_process(local_ray, algorithm, tmp_path: Path):
    """Same metrics every round (losses, accuracy, per-kind bytes) and the same weights file; the
    checkpoints taken every round fetch every role's state from the actors."""
    local = run(config(algorithm, tmp_path / "local"), progress=False)
    remote = run(config(algorithm, tmp_path / "ray", backend="ray", workers=2), progress=False)
    assert results(tmp_path / "local") == results(tmp_path / "ray")
    assert remote.pop("envelope_bytes") > remote["total_bytes"] and "envelope_bytes" not in local


def test_a_run_resumed_on_ray_ends_as_an_uninterrupted_one(local_ray, tmp_path: Path, monkeypatch):
    """FSL-SAGE, aligning every round: the checkpoint (server buffers, aux models, client parts)
    goes into the actors, and the resumed rounds end bit for bit as in process."""
    run(config("fsl_sage", tmp_path / "straight"), progress=False)
    crash_before_round(1, config("fsl_sage", tmp_path / "resumed"), monkeypatch)
    run(config("fsl_sage", tmp_path / "resumed", backend="ray", workers=2, resume=True), progress=False)
    assert results(tmp_path / "straight") == results(tmp_path / "resumed")


def test_more_workers_than_free_cpus_are_refused(local_ray, tmp_path: Path):
    with pytest.raises(UserError, match=r"backend=ray workers=5 needs 6 CPUs in the Ray cluster .* has 3"):
        run(config("fedavg", tmp_path / "o", backend="ray", workers=5), progress=False)
    assert not (tmp_path / "o").exists()


def test_ray_workers_import_the_plugins_of_the_run(local_ray, tmp_path: Path, monkeypatch):
    """The actors were started before the plugin existed, in another folder: the plugin's folder
    travels with the run (splitlab.plugins.ray_options), and the result is bit for bit."""
    from test_plugins import write_plugin

    folder = tmp_path / "mine"
    folder.mkdir()
    write_plugin(folder, "ray_plugin", "ray_fedavg")
    monkeypatch.syspath_prepend(str(folder))
    run(config("fedavg", tmp_path / "builtin"), progress=False)
    run(config("ray_fedavg", tmp_path / "ray", plugins="ray_plugin", backend="ray", workers=2), progress=False)
    assert results(tmp_path / "builtin") == results(tmp_path / "ray")
