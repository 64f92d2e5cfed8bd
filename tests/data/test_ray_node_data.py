"""backend=ray where the Ray workers cannot read the dataset the driver reads (as a node without
the files): the run stops before any round with one line naming the node (id and hostname) and the
cause, and no run directory made. A real local Ray whose workers are given
another $SPLITLAB_DATA than the driver's."""

from __future__ import annotations

import socket

import pytest
import ray
from test_data import write_cifar

from splitlab.engine import run
from splitlab.errors import UserError


def test_a_node_without_the_dataset_is_named_and_nothing_is_left(tmp_path, monkeypatch):
    write_cifar(tmp_path / "driver", "cifar10")
    monkeypatch.setenv("SPLITLAB_DATA", str(tmp_path / "driver"))
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"SPLITLAB_DATA": str(tmp_path / "elsewhere")}},
    )
    try:
        node = ray.get_runtime_context().get_node_id()
        out = tmp_path / "run"
        config = dict(dataset="cifar10", model="mlp", clients=2, rounds=1, batch_size=2, backend="ray", out=str(out))
        with pytest.raises(UserError) as refused:
            run(config, progress=False)
        message = str(refused.value)
        assert message.startswith(f"Ray node {node} ({socket.gethostname()}): cifar10 file")
        assert str(tmp_path / "elsewhere") in message  # where the node looked, not the driver
        assert "\n" not in message and not out.exists()
    finally:
        ray.shutdown()
