"""backend=ray on a Ray cluster on this machine (ray.cluster_utils: a head that runs no actor and
one-CPU nodes, so the client workers and the training server each land on a node of their own,
and any of them can be lost): an actor's process SIGKILLed, or a whole node removed, in the
middle of a round, and the run ends bit for bit as an undisturbed one."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from splitlab.engine import run
from test_ray_backend import config, kill_an_actor_mid_round, results


@pytest.fixture(scope="module")
def cluster():
    """A head with no CPU for actors (it holds the driver's objects) and three one-CPU nodes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each actor computes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(3):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def undisturbed(cluster, tmp_path_factory) -> Path:
    """PSL run in process (one torch thread): what every disturbed run on the cluster must end as."""
    out = tmp_path_factory.mktemp("undisturbed") / "run"
    run(config("psl", out), progress=False)
    return out


def sigkill(host) -> None:
    """SIGKILL the process of the actor `host`, as the kernel's OOM killer would."""
    os.kill(ray.get(host.__ray_call__.remote(lambda actor: os.getpid())), signal.SIGKILL)


def test_an_actor_process_killed_mid_round(cluster, undisturbed, tmp_path, monkeypatch, capsys):
    """PSL, 2 client workers and the server on 3 one-CPU nodes: the killed actor's CPU comes back
    and the actors are built again over the nodes; round 2 is replayed from round 1's checkpoint."""
    assert len([node for node in ray.nodes() if node["Alive"]]) == 4
    killed = kill_an_actor_mid_round(monkeypatch, kill=sigkill)
    run(config("psl", tmp_path / "killed", backend="ray", workers=2), progress=False)
    assert killed[-1].startswith("killed client")
    assert "replaying from the last checkpoint (restart 1 of at most 3)" in capsys.readouterr().err
    assert results(undisturbed) == results(tmp_path / "killed")


def test_a_node_lost_mid_round(cluster, undisturbed, tmp_path, monkeypatch, capsys):
    """A fourth node joins; in round 2 the node of the client worker about to take a backward step
    is removed (its raylet, object store and actor processes all stop): the actors are built again
    on the three nodes left, round 2 is replayed, and every number is the undisturbed run's."""
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    while ray.cluster_resources().get("CPU", 0) < 4:  # the new node's CPUs reach the driver's view a little later
        time.sleep(0.1)
    removed: list[str] = []

    def remove_its_node(host) -> None:
        node_id = ray.get(host.__ray_call__.remote(lambda actor: ray.get_runtime_context().get_node_id()))
        (node,) = [node for node in cluster.worker_nodes if node.node_id == node_id]
        cluster.remove_node(node)
        removed.append(node_id)

    killed = kill_an_actor_mid_round(monkeypatch, kill=remove_its_node)
    run(config("psl", tmp_path / "lost", backend="ray", workers=2), progress=False)
    assert killed[-1].startswith("killed client") and len(removed) == 1
    assert removed[0] not in {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    assert "replaying from the last checkpoint (restart 1 of at most 3)" in capsys.readouterr().err
    assert results(undisturbed) == results(tmp_path / "lost")
