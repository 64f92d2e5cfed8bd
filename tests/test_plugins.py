"""Extending splitlab from outside the package: a plugin module in a folder of the user's own
defines an algorithm, a model and a dataset, and runs through `plugins=` exactly as the built-ins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import splitlab
from helpers import quick
from splitlab.algorithms import algorithm_names, get_algorithm
from splitlab.algorithms.fedavg import FedAvg
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.resolve import resolve_config

PLUGIN = '''
"""A user's plugin: FedAvg under another name, the MLP and the synthetic data under others."""
import splitlab
from splitlab.algorithms.fedavg import FedAvg
from splitlab.data import DATASETS
from splitlab.models.zoo import mlp


class {cls}(FedAvg):
    name = "{name}"


splitlab.register_model("{name}_mlp", mlp)
splitlab.register_dataset("{name}_data", DATASETS["synthetic"])
'''


def write_plugin(folder: Path, module: str, name: str) -> None:
    cls = "".join(part.title() for part in name.split("_"))
    (folder / f"{module}.py").write_text(PLUGIN.format(cls=cls, name=name))


def same_run(a: Path, b: Path) -> None:
    """Bit for bit: every metric but time, and every weight."""

    def rows(path: Path) -> list[dict]:
        lines = (path / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if "seconds" not in k} for line in lines]

    assert rows(a) == rows(b)
    weights_a, weights_b = load_file(a / "weights.safetensors"), load_file(b / "weights.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(weights_a[k].equal(weights_b[k]) for k in weights_a)


def test_a_plugin_algorithm_model_and_dataset_equal_the_builtins_bit_for_bit(tmp_path, monkeypatch):
    plugins = tmp_path / "mine"
    plugins.mkdir()
    write_plugin(plugins, "my_plugin", "my_fedavg")
    monkeypatch.syspath_prepend(str(plugins))
    builtin = run(quick(algorithm="fedavg", out=str(tmp_path / "builtin")), progress=False)
    mine = run(
        quick(
            plugins="my_plugin",
            algorithm="my_fedavg",
            model="my_fedavg_mlp",
            dataset="my_fedavg_data",
            out=str(tmp_path / "mine_run"),
        ),
        progress=False,
    )
    assert mine["algorithm"] == "my_fedavg" and builtin["final_accuracy"] == mine["final_accuracy"]
    same_run(tmp_path / "builtin", tmp_path / "mine_run")


def test_a_subclass_defined_after_a_first_run_is_found(tmp_path):
    run(quick(algorithm="fedavg", rounds=1, out=str(tmp_path / "first")), progress=False)
    assert "late_fedavg" not in algorithm_names()

    class LateFedAvg(FedAvg):
        name = "late_fedavg"

    assert get_algorithm("late_fedavg") is LateFedAvg
    run(quick(algorithm="late_fedavg", rounds=1, out=str(tmp_path / "late")), progress=False)
    run(quick(algorithm="fedavg", rounds=1, out=str(tmp_path / "again")), progress=False)
    same_run(tmp_path / "late", tmp_path / "again")


def test_two_classes_claiming_one_name_is_a_user_error():
    class First(FedAvg):
        name = "claimed_twice"

    class Second(FedAvg):
        name = "claimed_twice"

    with pytest.raises(UserError, match="algorithm name 'claimed_twice' is taken twice: by .*First and by .*Second"):
        get_algorithm("fedavg")
    del First, Second
    import gc

    gc.collect()  # the classes are gone: the registry is whole again
    assert "claimed_twice" not in algorithm_names()


def test_the_cli_imports_a_plugin_from_the_folder_it_is_started_in(tmp_path):
    """As a user runs it: `splitlab run plugins=...` in their own folder, a fresh process."""
    write_plugin(tmp_path, "cli_plugin", "cli_fedavg")
    settings = [f"{k}={v}" for k, v in quick(algorithm="cli_fedavg", out="runs/x", plugins="cli_plugin").items()]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [Path(sys.executable).parent / "splitlab", "run", *settings],  # the console script: cwd not on sys.path
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    stored = (tmp_path / "runs/x/config.yaml").read_text()
    assert "plugins: cli_plugin" in stored and "algorithm: cli_fedavg" in stored


def test_a_missing_plugin_is_one_line_naming_it():
    with pytest.raises(UserError, match="plugin module 'no_such_plugin_here' .* is not importable") as error:
        resolve_config({"plugins": "no_such_plugin_here"})
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="'a-b' is not a module name"):
        resolve_config({"plugins": "a-b"})


def test_built_in_names_cannot_be_registered_again():
    with pytest.raises(UserError, match="cannot register model 'cnn'"):
        splitlab.register_model("cnn", lambda shape, classes: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(UserError, match="cannot register dataset 'digits'"):
        splitlab.register_dataset("digits", lambda data_dir, seed: None)  # type: ignore[arg-type,return-value]


def test_entry_points_of_installed_packages_are_imported(tmp_path, monkeypatch):
    """A package that declares `[project.entry-points."splitlab.plugins"]` is imported with no key set."""
    dist = tmp_path / "site"
    (dist / "ep_plugin_pkg-1.0.dist-info").mkdir(parents=True)
    (dist / "ep_plugin_pkg-1.0.dist-info" / "METADATA").write_text("Name: ep-plugin-pkg\nVersion: 1.0\n")
    (dist / "ep_plugin_pkg-1.0.dist-info" / "entry_points.txt").write_text(
        textwrap.dedent(
            """
            [splitlab.plugins]
            mine = ep_plugin
            """
        )
    )
    write_plugin(dist, "ep_plugin", "ep_fedavg")
    monkeypatch.syspath_prepend(str(dist))
    from splitlab import plugins

    plugins._load_entry_points.cache_clear()
    assert resolve_config({"algorithm": "ep_fedavg"}).run.algorithm == "ep_fedavg"


DEEP = '''
"""A user's model with a key of its own: an MLP of `depth` hidden layers."""
from collections import OrderedDict

from pydantic import BaseModel, Field
from torch import nn

import splitlab
from splitlab.models import StagedModel


class DeepParams(BaseModel):
    depth: int = Field(2, ge=1, le=8, description="hidden layers")


def deep(input_shape, num_classes, depth):
    width = 1
    for size in input_shape:
        width *= size
    stages = OrderedDict(hidden1=nn.Sequential(nn.Flatten(), nn.Linear(width, 16), nn.ReLU()))
    for i in range(2, depth + 1):
        stages[f"hidden{i}"] = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
    stages["out"] = nn.Linear(16, num_classes)
    return StagedModel(stages)


splitlab.register_model("deep", deep, params=DeepParams, inputs=["images", "features"])
'''


@pytest.fixture
def deep_plugin(tmp_path, monkeypatch) -> str:
    (tmp_path / "deep_plugin.py").write_text(DEEP)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "deep_plugin", raising=False)  # imported (and registered) afresh
    return "deep_plugin"


def test_a_plugin_models_own_key_runs_and_is_listed(deep_plugin, tmp_path, capsys):
    from splitlab.cli import main

    out = tmp_path / "deep"
    settings = [f"{k}={v}" for k, v in quick(model="deep", plugins=deep_plugin).items()]
    assert main(["run", "--no-progress", *settings, "depth=3", f"out={out}"]) == 0
    weights = load_file(out / "weights.safetensors")
    assert sorted({k.split(".")[0] for k in weights}) == ["hidden1", "hidden2", "hidden3", "out"]
    assert "depth: 3" in (out / "config.yaml").read_text()
    capsys.readouterr()
    assert main(["run", *(f"{k}={v}" for k, v in quick().items()), "depth=3", f"out={tmp_path / 'x'}"]) == 2
    assert capsys.readouterr().err == "error: depth applies to model deep, not mlp\n"
    assert main(["run", "model=deep", "depth=9", f"out={tmp_path / 'x'}"]) == 2
    assert "invalid value 9 for depth" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert main(["models", f"plugins={deep_plugin}"]) == 0
    listed = capsys.readouterr().out
    assert "deep " in listed and "depth=2" in listed and "layers=4" in listed
    with pytest.raises(SystemExit):
        main(["run", "--help", f"plugins={deep_plugin}"])
    assert "keys of model=deep:\n  depth=2\n      hidden layers" in capsys.readouterr().out


def test_listing_commands_show_a_plugins_items(tmp_path, monkeypatch, capsys):
    from splitlab.cli import main

    write_plugin(tmp_path, "listed_plugin", "listed_fedavg")
    monkeypatch.chdir(tmp_path)
    assert main(["algorithms", "plugins=listed_plugin"]) == 0
    assert "listed_fedavg" in capsys.readouterr().out
    assert main(["datasets", "plugins=listed_plugin"]) == 0
    assert "listed_fedavg_data" in capsys.readouterr().out
    assert main(["algorithms", "plugin=listed_plugin"]) == 2
    assert "did you mean 'plugins'?" in capsys.readouterr().err


def test_run_takes_a_typed_run_config_and_params_as_a_dict(deep_plugin, tmp_path):
    """`splitlab.run(RunConfig(...), Params(...))` is `run(dict)` with the same keys, bit for bit."""
    import importlib

    from splitlab.algorithms.sfl_v2 import SFLV2Params

    settings = quick(model="deep", plugins=deep_plugin, algorithm="sfl_v2")
    typed = splitlab.run(
        splitlab.RunConfig(**settings, out=str(tmp_path / "typed")),
        SFLV2Params(server_schedule="sequential"),
        importlib.import_module(deep_plugin).DeepParams(depth=1),
        progress=False,
    )
    flat = run({**settings, "server_schedule": "sequential", "depth": 1, "out": str(tmp_path / "flat")}, progress=False)
    assert typed["final_accuracy"] == flat["final_accuracy"]
    same_run(tmp_path / "typed", tmp_path / "flat")


def test_a_plugin_split_algorithm_written_the_natural_way_runs_and_is_refused_u_shaped_in_one_line():
    """forward, the server's train_step, backward: sfl_v2 bit for bit at one cut; `cut=1,2` and
    `precision=fp16` are refused in one line, as the algorithm does not declare their support."""
    from helpers import global_weights, train
    from splitlab.algorithms.base import Algorithm, ClientInfo
    from splitlab.config import NoParams

    class NaturalSplit(Algorithm[NoParams]):
        name = "natural_split"

        def train_round(self, rnd: int, clients: list[ClientInfo]) -> None:
            for client in clients:
                self.download(client.id)
            for k, step in self.ctx.interleaved(rnd, clients):
                node = self.client(clients[k].id)
                sent = node.forward(step)
                reply = self.server.train_step(sent["smashed"], sent["labels"])
                node.backward(step, reply["cut_grad"])
            self.federated_average(clients)

    mine, builtin = (global_weights(train(2, **quick(algorithm=name))) for name in ("natural_split", "sfl_v2"))
    assert mine.keys() == builtin.keys() and all(torch.equal(mine[n], builtin[n]) for n in mine)
    with pytest.raises(UserError) as error:
        resolve_config(quick(algorithm="natural_split", cut="1,2"))
    message = str(error.value)
    assert "cut=1,2" in message and "algorithm=natural_split" in message and "supports_u_shape" in message
    assert "\n" not in message
    with pytest.raises(UserError, match="algorithm=natural_split does not declare it .supports_fp16"):
        resolve_config(quick(algorithm="natural_split", precision="fp16"))  # every built-in declares it
    del NaturalSplit
    import gc

    gc.collect()


def test_declaring_u_shape_support_without_a_client_that_holds_the_tail_is_refused_at_definition():
    from splitlab.algorithms.sfl_v2 import SFLV2
    from splitlab.roles import ClientNode

    with pytest.raises(
        TypeError, match="Careless declares supports_u_shape, but its Client ClientNode does not extend"
    ):

        class Careless(SFLV2):
            name = "careless"
            Client = ClientNode

    import gc

    gc.collect()  # the half-made class leaves the registry
    assert "careless" not in algorithm_names()
