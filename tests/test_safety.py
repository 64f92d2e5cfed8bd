"""Issue 12: bad input is refused with one line, nothing is lost and nothing is silent."""

from __future__ import annotations

import pytest

from splitlab.cli import main
from splitlab.config import load_config_file, parse_overrides, resolve_config
from splitlab.errors import UserError


@pytest.mark.parametrize("setting, named", [
    ({"lr": float("inf")}, "lr"), ({"weight_decay": float("inf")}, "weight_decay"),
    ({"lr": "inf"}, "lr"), ({"seed": -1}, "seed"), ({"seed": 2 ** 32}, "seed"),
    ({"clients": True}, "clients"), ({"rounds": False}, "rounds"),
])
def test_bad_numbers_are_refused_up_front(setting, named):
    with pytest.raises(UserError, match=named):
        resolve_config(setting)


def test_booleans_and_largest_seed_still_accepted():
    config = resolve_config({"seed": 2 ** 32 - 1, "resume": True})
    assert config.run.seed == 2 ** 32 - 1 and config.run.resume is True


def test_duplicate_key_on_the_command_line_is_refused():
    with pytest.raises(UserError, match="'lr' is given twice"):
        parse_overrides(["lr=1", "rounds=2", "lr=2"])


def test_duplicate_key_in_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lr: 1\nrounds: 2\nlr: 2\n")
    with pytest.raises(UserError, match="'lr' is given twice"):
        load_config_file(path)


def test_cli_gives_one_line_and_exit_2(capsys):
    assert main(["run", "lr=.inf", "rounds=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lr" in err
