"""The attack registry: the names `splitlab attack` takes are the registered attacks, and a run
that cannot give what an attack needs is refused in one line saying so."""

from __future__ import annotations

import gc
import json
import sys

import pytest
import yaml

from helpers import quick
from splitlab import run
from splitlab.audit.attack import ATTACK_MODULES, attacks
from splitlab.audit.run import attack_run
from splitlab.cli import main
from splitlab.errors import UserError


def test_every_builtin_attack_is_registered_first_in_its_listed_order_and_declares_its_needs():
    registered = {name: cls for name, cls in attacks().items() if cls.__module__.startswith("splitlab.")}
    assert tuple(attacks())[: len(ATTACK_MODULES)] == tuple(registered) == ATTACK_MODULES
    for name, cls in registered.items():
        assert cls.name == name and cls.inputs and set(cls.inputs) <= {"images", "table rows", "tokens"} and cls.why
    assert [name for name, cls in registered.items() if cls.vertical] == ["inversion", "label_leak"]


def test_an_attack_on_a_vertical_run_of_the_parties_own_files_says_what_it_needs(tmp_path):
    """No process holds every party's columns, and nothing was recorded: not the advice to start a
    server and parties (which is how such a run was made), but what the attack needs."""
    config = dict(setting="vertical", algorithm="sl", dataset="csv", model="mlp", labels_at=0, data="own")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    for attack in ("inversion", "label_leak"):
        with pytest.raises(UserError) as error:
            attack_run(tmp_path, {"attack": attack})
        message = str(error.value)
        assert message.startswith(f"attack={attack} on a vertical run needs every party's columns of the test samples")
        assert "data=own run" in message and "\n" not in message and "splitlab server" not in message
    with pytest.raises(UserError, match="attack=fsha is not offered for a vertical run; offered: inversion"):
        attack_run(tmp_path, {"attack": "fsha"})


PLUGIN_ATTACK = """
from splitlab.audit.attack import Attack


class CountTargets(Attack):
    name = "count_targets"
    inputs = ("images", "table rows")
    why = "it counts what the server received"

    def run(self, target):
        inputs, smashed = target.observed()
        return {"targets_seen": len(inputs), "width": int(smashed[0].numel())}

    @staticmethod
    def rows(result):
        return [("targets seen", str(result["targets_seen"]))]
"""


@pytest.fixture
def plugin_attack(tmp_path, monkeypatch):
    """A module of the user's own defining an attack; gone from the registry after the test."""
    (tmp_path / "my_attack.py").write_text(PLUGIN_ATTACK)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_attack"
    sys.modules.pop("my_attack", None)
    gc.collect()  # the class is unreachable now: Attack.__subclasses__ forgets it


def test_a_plugin_attack_runs_through_plugins_and_is_listed_after_the_builtins(tmp_path, capsys, plugin_attack):
    out = tmp_path / "run"
    run({**quick(algorithm="sfl_v2", record=20, rounds=1), "out": str(out)}, progress=False)
    assert main(["attack", str(out), "attack=count_targets"]) == 2  # without its module: not an attack
    assert "invalid value 'count_targets' for attack" in capsys.readouterr().err
    assert main(["attack", str(out), "attack=count_targets", f"plugins={plugin_attack}"]) == 0
    assert "targets seen" in capsys.readouterr().out
    result = json.loads((out / "attack.json").read_text())["count_targets"]
    assert result["targets_seen"] == 20 and result["width"] == 200 and result["settings"]["plugins"] == plugin_attack
    assert tuple(attacks()) == (*ATTACK_MODULES, "count_targets")
