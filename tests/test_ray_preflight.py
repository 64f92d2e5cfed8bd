"""Ray pre-flight, through the CLI: an address where nothing listens fails at once with one line and
exit 2, before any run or sweep directory (or lock) is made; no Ray is started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import ray

from splitlab.cli import main

NOBODY = "127.0.0.1:1"  # a port nothing listens on


@pytest.fixture(autouse=True)
def no_ray_yet():
    ray.shutdown()  # the Ray tests' local Ray (tests/conftest.py), if running: else connect() contacts no address
    yield
    assert not ray.is_initialized()


def test_backend_ray_with_ray_address_where_nothing_listens(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", NOBODY)
    out = tmp_path / "run"
    code = main(["run", "dataset=synthetic", "model=mlp", "clients=2", "rounds=1", "backend=ray", f"out={out}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"nothing answers at Ray address {NOBODY!r}" in err
    assert not out.exists()


def test_sweep_on_a_ray_address_where_nothing_listens(tmp_path, capsys):
    spec = tmp_path / "s.yaml"
    spec.write_text(json.dumps({"base": {"dataset": "synthetic", "model": "mlp"}, "axes": {"seed": [0, 1]}}))
    out = tmp_path / "sweep"
    code = main(["sweep", str(spec), "--out", str(out), "--ray", NOBODY])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert f"nothing answers at Ray address {NOBODY!r}" in err
    assert not out.exists()


HEAD = """
import sys
from ray.cluster_utils import Cluster
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
print(cluster.address, flush=True)
sys.stdin.read()
cluster.shutdown()
"""


def test_backend_ray_without_the_token_or_with_another_of_a_token_auth_cluster(tmp_path):
    """A head started with token authentication (RAY_AUTH_MODE=token, its token in RAY_AUTH_TOKEN);
    a run without the token (none in the environment nor in ~/.ray) and one with another token
    (both at once) fail at once, each in one line naming the cause and what to set, exit 2,
    nothing written (no run directory, no lock)."""
    ray_free = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0123456789abcdef0123456789abcdef"}
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    head = subprocess.Popen([sys.executable, "-c", HEAD], env={**ray_free, **token}, **pipes)
    tokens = {"missing": {}, "wrong": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 32}}
    try:
        address = head.stdout.readline().strip()
        home = tmp_path / "home"  # no ~/.ray/auth_token
        home.mkdir()
        env = {**ray_free, "HOME": str(home), "RAY_ADDRESS": address, "PYTHONPATH": os.pathsep.join(sys.path)}
        runs = {
            case: subprocess.Popen(
                [sys.executable, "-m", "splitlab", "run", "dataset=synthetic", "model=mlp", "backend=ray"]
                + [f"out={tmp_path / case}"],
                env={**env, **auth},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for case, auth in tokens.items()
        }
        stderrs = {case: process.communicate()[1] for case, process in runs.items()}
        refused = {case: (runs[case].returncode, stderr) for case, stderr in stderrs.items()}
    finally:
        head.communicate("")
    for case, (code, stderr) in refused.items():
        errors = [line for line in stderr.splitlines() if line.startswith("error:") or "Traceback" in line]
        assert code == 2 and len(errors) == 1, (case, stderr)
        assert f"Ray at {address!r} uses token authentication and refused this process" in errors[0]
        assert "set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN" in errors[0]
        assert not (tmp_path / case).exists()
