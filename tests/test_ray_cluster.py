"""backend=ray on a Ray cluster on this machine (ray.cluster_utils: a head that runs no actor and
one-CPU nodes, so the client workers and the training server each land on a node of their own,
and any of them can be lost): in one run, an actor's process SIGKILLed in the middle of round 1,
then a whole node removed in the middle of round 2, and the run ends bit for bit as an
undisturbed one."""

from __future__ import annotations

import os
import signal
import time

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


def sigkill(host) -> None:
    """SIGKILL the process of the actor `host`, as the kernel's OOM killer would."""
    os.kill(ray.get(host.__ray_call__.remote(lambda actor: os.getpid())), signal.SIGKILL)


def test_an_actor_process_killed_then_a_node_lost_mid_round(cluster, tmp_path, monkeypatch, capsys):
    """PSL, 2 client workers and the server on one-CPU nodes, one node to spare. In round 1 an
    actor's process is SIGKILLed: its CPU comes back and the actors are built again over the nodes.
    In round 2 the node of the client worker about to take a backward step is removed (its raylet,
    object store and actor processes all stop): the actors are built again on the three nodes
    left. Each time the round is replayed, and every number is the undisturbed run's."""
    run(config("psl", tmp_path / "undisturbed"), progress=False)
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

    killed = kill_an_actor_mid_round(monkeypatch, round_index=0, kill=sigkill)
    lost = kill_an_actor_mid_round(monkeypatch, round_index=1, kill=remove_its_node)
    run(config("psl", tmp_path / "disturbed", backend="ray", workers=2), progress=False)
    assert killed[-1].startswith("killed client") and lost[-1].startswith("killed client") and len(removed) == 1
    assert removed[0] not in {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    err = capsys.readouterr().err
    assert "replaying from the last checkpoint (restart 1 of at most 3)" in err
    assert "replaying from the last checkpoint (restart 2 of at most 3)" in err
    assert results(tmp_path / "undisturbed") == results(tmp_path / "disturbed")
