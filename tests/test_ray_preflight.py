"""Ray pre-flight, through the CLI: an address where nothing listens fails at once with one line and
exit 2, before any run or sweep directory (or lock) is made; no Ray is started."""

from __future__ import annotations

import json

import pytest
import ray

from splitlab.cli import main

NOBODY = "127.0.0.1:1"  # a port nothing listens on


@pytest.fixture(autouse=True)
def no_ray_yet():
    assert not ray.is_initialized()  # else connect() would not contact the address
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
