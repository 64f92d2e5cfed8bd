"""The attack registry: the names `splitlab attack` takes are the registered attacks, and a run
that cannot give what an attack needs is refused in one line saying so."""

from __future__ import annotations

import typing

import pytest
import yaml

from splitlab.audit.attack import attacks
from splitlab.audit.run import attack_run
from splitlab.audit.settings import AttackSettings
from splitlab.errors import UserError


def test_every_attack_offered_is_registered_and_declares_its_needs():
    offered = typing.get_args(AttackSettings.model_fields["attack"].annotation)
    registered = attacks()
    assert tuple(registered) == offered
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
