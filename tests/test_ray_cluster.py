"""backend=ray when an actor is lost: on the Ray tests' local Ray (tests/conftest.py), an actor's
process SIGKILLed in the middle of a round, for each family whose state takes a path of its own
through the checkpoint into the rebuilt actors (and SFL-V2 with noise at the cut, resumed on Ray),
ends bit for bit as the in-process run; on a Ray cluster on this machine (ray.cluster_utils: a head
that runs no actor and one-CPU nodes, so the client workers and the training server each land on a
node of their own), in one PSL run, an actor's process SIGKILLed in round 1, then a whole node
removed in round 2, the same."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from helpers import crash_before_round
from splitlab.engine import run
from test_ray_backend import always_elsewhere, config, kill_an_actor_mid_round, results, rows_of


def started_head() -> Cluster:
    """Ray's head, started again if its raylet does not register within Ray's fixed 30 s: seen once
    on a fresh clone's CI, right after the previous module's Ray had shut down (the new raylet wrote
    no log at all); a start-up failure of Ray's, not of what these tests check."""
    head = {"num_cpus": 0, "include_dashboard": False}
    for _ in range(2):
        try:
            return Cluster(initialize_head=True, head_node_args=head)
        except Exception as error:
            if "timed out during startup" not in str(error):
                raise
            time.sleep(2)
    return Cluster(initialize_head=True, head_node_args=head)  # a third failure is the test's


@pytest.fixture
def cluster():
    """A head with no CPU for actors (it holds the driver's objects) and four one-CPU nodes, in place
    of the Ray tests' local Ray (started again by the next test that asks for it)."""
    ray.shutdown()
    cluster = started_head()
    for _ in range(4):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    while ray.cluster_resources().get("CPU", 0) < 4:  # the nodes' CPUs reach the driver's view a little later
        time.sleep(0.1)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


#: CSE-FSL's federated strategies: FedProx, SCAFFOLD, FedYogi
STRATEGIES = {
    "optimizer": "sgd",
    "lr": 0.05,
    "prox_mu": 0.1,
    "scaffold": True,
    "server_opt": "yogi",
    "server_opt_lr": 0.01,
}


def sigkill(host) -> None:
    """SIGKILL the process of the actor `host`, as the kernel's OOM killer would."""
    os.kill(ray.get(host.__ray_call__.remote(lambda actor: os.getpid())), signal.SIGKILL)


@pytest.mark.parametrize(
    ("algorithm", "extra", "workers", "moved"),
    [
        ("sl", {}, 1, False),  # one client after another (a second worker would have nothing to do); its
        # resume is tested nowhere else
        ("sfl_v1", {"cut": "1,2"}, 2, False),  # U-shaped: each client training at once has its server copy
        # moved: the working copies downloaded before it trains go with it, and with FedProx, SCAFFOLD
        # and FedYogi each client's c_i and the round's c (their bytes: control_down, control_up)
        ("cse_fsl", STRATEGIES, 2, True),
        ("fsl_sage", {}, 1, False),  # aligning every round: server buffers, aux models from the checkpoint
        ("splitgp", {}, 2, True),  # moved: its kept model and optimizer go with it
    ],
)
def test_a_family_ends_bit_for_bit_after_an_actor_is_killed_mid_round(
    local_ray, algorithm, extra, workers, moved, tmp_path, monkeypatch, capsys
):
    """The client workers and the server on the local Ray. In round 2 the process of the actor
    holding the first client to get its cut gradient (or to take a step of its own) is SIGKILLed:
    a new actor takes its place, the roles are built again in it and in the actors still alive (not
    started again), and the round is replayed from round 1's checkpoint, which goes into all of them.
    Every number (losses, accuracy, per-kind bytes) and the weights are the
    in-process run's. `moved`: every client that trains goes to another worker (its state with it).
    The families whose state takes a path of its own through the checkpoint into the actors; the
    others' replay is the same code (engine.run), and they are bit for bit on Ray
    (tests/test_ray_backend.py: fedavg, sglr, cycle_sfl) and when resumed in process
    (tests/test_loggers.py: fedavg; tests/algorithms: sglr, cycle_sfl). psl, and sfl_v2 with a
    defense: the tests below."""
    local = run(config(algorithm, tmp_path / "local", **extra), progress=False)
    if moved:
        always_elsewhere(monkeypatch)
    killed = kill_an_actor_mid_round(monkeypatch, round_index=1, kill=sigkill)
    remote = run(config(algorithm, tmp_path / "ray", backend="ray", workers=workers, **extra), progress=False)
    assert killed[-1].startswith("killed client")
    assert "replaying from the last checkpoint (restart 1 of at most 3)" in capsys.readouterr().err
    assert results(tmp_path / "local") == results(tmp_path / "ray")
    assert remote.pop("envelope_bytes") > remote["total_bytes"] and "envelope_bytes" not in local
    assert remote["comm_bytes_by_client"] == local["comm_bytes_by_client"]  # actors' bytes by client id alike
    rows = rows_of(tmp_path / "ray")
    assert all(row["driver_actor_bytes"] > 0 and row["round_compute_seconds"]["client"] > 0 for row in rows)
    assert not moved or all(row["ray_client_moves"] > 0 for row in rows)
    assert not extra.get("scaffold") or rows[-1]["comm_bytes_by_kind"]["control_up"] > 0
    # each attempt's first row: every actor started, then only the one lost (the others rebuilt)
    assert [row["ray_actors_started"] for row in rows if "ray_actors_started" in row] == [workers + 1, 1]


def test_a_defended_run_resumed_on_ray_and_killed_mid_round_keeps_its_private_noise_key(
    local_ray, tmp_path, monkeypatch
):
    """SFL-V2 with noise at the cut and no noise_key: the key drawn at the start is in the
    checkpoint. Stopped before round 2 in process, resumed on Ray (the actors get the key from the
    driver), an actor SIGKILLed mid-round (the new actor and the rebuilt ones get it again): bit for
    bit the run resumed in process."""
    defended = {"defense": "clip:5+noise:0.3+gradnoise:0.5"}
    crash_before_round(1, config("sfl_v2", tmp_path / "local", **defended), monkeypatch)
    shutil.copytree(tmp_path / "local", tmp_path / "ray")
    run(config("sfl_v2", tmp_path / "local", resume=True, **defended), progress=False)
    killed = kill_an_actor_mid_round(monkeypatch, round_index=1, kill=sigkill)
    run(config("sfl_v2", tmp_path / "ray", backend="ray", workers=1, resume=True, **defended), progress=False)
    assert killed[-1].startswith("killed client")
    assert results(tmp_path / "local") == results(tmp_path / "ray")


def test_an_actor_process_killed_then_a_node_lost_mid_round(cluster, tmp_path, monkeypatch, capsys):
    """On the cluster: PSL, 2 client workers and the server on one-CPU nodes, one node to spare. In round 1 an
    actor's process is SIGKILLed: its CPU comes back and a new actor takes its place. In round 2 the
    node of the client worker about to take a backward step is removed (its raylet, object store and
    actor processes all stop): a new actor starts on a node left. Each time the roles are built again
    in the new actor and the two still alive, the round is replayed, and every number is the
    undisturbed run's."""
    run(config("psl", tmp_path / "undisturbed"), progress=False)
    removed: list[str] = []

    def remove_its_node(host) -> None:
        node_id = ray.get(host.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id()))
        (node,) = [node for node in cluster.worker_nodes if node.node_id == node_id]
        cluster.remove_node(node)
        removed.append(node_id)

    killed = kill_an_actor_mid_round(monkeypatch, round_index=0, kill=sigkill)
    lost = kill_an_actor_mid_round(monkeypatch, round_index=1, kill=remove_its_node)
    run(config("psl", tmp_path / "disturbed", backend="ray", workers=2), progress=False)
    assert killed[-1].startswith("killed client") and lost[-1].startswith("killed client") and len(removed) == 1
    assert removed[0] not in {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    err = capsys.readouterr().err
    assert "replaying from the last checkpoint (restart 1 of at most 3)" in err
    assert "replaying from the last checkpoint (restart 2 of at most 3)" in err
    assert results(tmp_path / "undisturbed") == results(tmp_path / "disturbed")
    # the first attempt (3 actors), lost in round 1, wrote no row; each later attempt started one
    started = [row["ray_actors_started"] for row in rows_of(tmp_path / "disturbed") if "ray_actors_started" in row]
    assert started == [1, 1]
