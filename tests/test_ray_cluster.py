"""backend=ray on a Ray cluster of three nodes on this machine (ray.cluster_utils: a head and two
more raylets, one CPU each, so the client workers and the training server land on different
nodes): an actor's process SIGKILLed in the middle of a round, and the run ends bit for bit as
an undisturbed one."""

from __future__ import annotations

import os
import signal

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from splitlab.engine import run
from test_ray_backend import config, kill_an_actor_mid_round, results


@pytest.fixture(scope="module")
def three_nodes():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each actor computes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()
    torch.set_num_threads(threads)


def sigkill(host) -> None:
    """SIGKILL the process of the actor `host`, as the kernel's OOM killer or a dying node would."""
    os.kill(ray.get(host.__ray_call__.remote(lambda actor: os.getpid())), signal.SIGKILL)


def test_an_actor_process_killed_mid_round_on_three_nodes(three_nodes, tmp_path, monkeypatch, capsys):
    """PSL, 2 client workers and the server on 3 one-CPU nodes: the killed actor's CPU comes back
    and the actors are built again over the nodes; round 2 is replayed from round 1's checkpoint."""
    assert len([node for node in ray.nodes() if node["Alive"]]) == 3
    run(config("psl", tmp_path / "undisturbed"), progress=False)
    killed = kill_an_actor_mid_round(monkeypatch, kill=sigkill)
    run(config("psl", tmp_path / "killed", backend="ray", workers=2), progress=False)
    assert killed[-1].startswith("killed client")
    assert "replaying from the last checkpoint (restart 1 of at most 3)" in capsys.readouterr().err
    assert results(tmp_path / "undisturbed") == results(tmp_path / "killed")
