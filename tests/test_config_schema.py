"""Generated from the settings schema itself (splitlab.catalog.command_settings): for every key of
every command, a value of the wrong type (text where a number, name or list is expected), a boolean or
non-finite number for a number, a number just out of range, and (RunConfig) a key set where it does
not apply end the command with exit code 2 and one line naming the key. A key added without a range
or an applicability rule fails here, with what to add."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from splitlab import catalog
from splitlab.cli import main
from splitlab.config import EVERYWHERE, GROUPS, ONLY_WHEN, RunConfig, accepts, bound_value, field_bounds
from splitlab.settings import SETTINGS as RUN_SETTINGS

SETTINGS = catalog.command_settings()
CASES = [(command, key) for command, model in SETTINGS.items() for key in model.model_fields]


def argv(command: str, tmp_path: Path, *pairs: str) -> list[str]:
    """The command line of `command` with `pairs`, aimed at places where nothing is (nothing may run)."""
    name, *fixed = command.split()
    where = {
        "evaluate": [str(tmp_path / "none")],
        "attack": [str(tmp_path / "none"), "attack=inversion"],
        "generate": [str(tmp_path / "none")] + ([] if any(p.startswith("prompt=") for p in pairs) else ["prompt=x"]),
    }
    out = (
        [f"out={tmp_path / 'out'}"]
        if name in ("run", "advise") and not any(p.startswith("out=") for p in pairs)
        else []
    )
    return [name, *where.get(name, []), *fixed, *out, *pairs]


def refused(capsys, args: list[str], key: str) -> None:
    assert main(args) == 2, args
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and key in err, (args, err)


@pytest.mark.parametrize(("command", "key"), CASES, ids=[f"{c}:{k}" for c, k in CASES])
def test_every_key_has_a_range_and_refuses_bad_values(command, key, tmp_path, capsys):
    field = SETTINGS[command].model_fields[key]
    if not (accepts(field.annotation, str) or accepts(field.annotation, Path)):  # these keep any text typed
        refused(capsys, argv(command, tmp_path, f"{key}={{a: 1}}"), key)  # text of no number, name or list
    bounds = field_bounds(field)
    if bounds is None:
        return
    lower, upper = bounds
    assert lower is not None and upper is not None, (
        f"{command} key {key!r} takes a number but has no {'lower' if lower is None else 'upper'} bound: "
        f"add ge=/gt= and le=/lt= to its Field (then run `python -m splitlab.catalog` for docs/cli.md)"
    )
    low, high = bound_value(lower), bound_value(upper)
    below = low if type(lower).__name__ == "Gt" else low - 1
    above = high if type(upper).__name__ == "Lt" else high * 2 if isinstance(high, float) else high + 1
    for value in (below, above, "true", ".inf", ".nan"):
        refused(capsys, argv(command, tmp_path, f"{key}={value}"), key)


def _documented() -> set[str]:
    """The keys in docs/cli.md's table of the keys every run understands."""
    text = Path(catalog.DOCS).read_text().split("## Keys every run understands")[1]
    table = text[text.index("\n|") :].split("\n\n")[0]
    return {key for cell in re.findall(r"^\| ([^|]+) \|", table, re.M) for key in re.findall(r"`(\w+)`", cell)}


def test_every_run_key_is_documented_and_says_where_it_applies():
    keys = set(RunConfig.model_fields)
    assert keys == _documented(), "every key of RunConfig needs a row in docs/cli.md's table, and only those"
    for key in keys:
        extra = RunConfig.model_fields[key].json_schema_extra
        assert isinstance(extra, dict) and extra.get("group") in GROUPS, (
            f"key {key!r}: tag its Field with the concern it belongs to: json_schema_extra=DATA, MODEL, TRAINING, "
            f"PRIVACY or DEPLOYMENT (splitlab.config.GROUPS), as `run --help` and docs/cli.md group it"
        )
        settings_own = [name for name, setting in RUN_SETTINGS.items() if key in setting.own_keys]
        assert (key in EVERYWHERE) + (key in ONLY_WHEN) + len(settings_own) == 1, (
            f"key {key!r}: add it to splitlab.config.EVERYWHERE (applies to every run), to ONLY_WHEN "
            f"(Applies(when, why, example)) or to the own_keys of the one setting that takes it"
        )
    assert all(set(setting.refused_keys) <= EVERYWHERE | set(ONLY_WHEN) for setting in RUN_SETTINGS.values())


@pytest.mark.parametrize("key", sorted(ONLY_WHEN))
def test_a_key_where_it_does_not_apply_is_refused(key, tmp_path, capsys):
    example = ONLY_WHEN[key].example
    assert key in example and RunConfig.model_fields[key].default != example[key]
    pairs = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in example.items()]
    refused(capsys, argv("run", tmp_path, *pairs), f"{key}=")
    assert not (tmp_path / "out").exists()


#: a run of each setting given a key it does not take
SETTING_EXAMPLES = {
    ("vanilla", "parties"): ["parties=3"],
    ("vanilla", "features"): ["features=0-3/4-7"],
    ("vanilla", "labels_at"): ["labels_at=0"],
    ("vanilla", "combine"): ["combine=sum"],
    ("vertical", "eval_generate"): ["algorithm=sl", "eval_generate=4"],
    ("vertical", "tail_cut"): ["algorithm=sl", "cut=1,2"],
    ("vertical", "grad_accum"): ["algorithm=sl", "grad_accum=2"],
    ("vertical", "clip_scope"): ["algorithm=sl", "max_grad_norm=1", "clip_scope=global"],
}


def test_every_key_a_setting_does_not_take_has_an_example():
    expected = {
        (name, key)
        for name, setting in RUN_SETTINGS.items()
        for key in [
            *setting.refused_keys,
            *(k for other in RUN_SETTINGS.values() if other is not setting for k in other.own_keys),
        ]
    }
    assert set(SETTING_EXAMPLES) == expected


@pytest.mark.parametrize(("setting", "key"), sorted(SETTING_EXAMPLES))
def test_a_key_the_setting_does_not_take_is_refused(setting, key, tmp_path, capsys):
    """The setting declares it (splitlab.settings: own_keys, refused_keys), in one line naming the key."""
    refused(capsys, argv("run", tmp_path, f"setting={setting}", *SETTING_EXAMPLES[setting, key]), f"{key}=")
    assert not (tmp_path / "out").exists()


def test_the_ranges_in_the_docs_are_the_schemas():
    assert catalog.ranges_markdown() in Path(catalog.DOCS).read_text(), "run `python -m splitlab.catalog`"


def test_odd_inputs_outside_the_schema_are_one_line(tmp_path, capsys, monkeypatch):
    binary = tmp_path / "config.yaml"
    binary.write_bytes(b"\x00\x01\xff\xfe\x80 not text")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for args, message in [
        (["run", "--config", str(binary)], "is not a UTF-8 text file"),
        (["run", "--config", str(tmp_path)], "is a folder, not a file"),
        (["launch", "listen=0.0.0.0:7000"], "listen= does not apply to launch"),
        (["launch", "certs=/tmp"], "certs= does not apply to launch"),
        (["certs", "clients=100000", f"out={tmp_path / 'c'}"], "less than or equal to 1000"),
        (["certs", "clients=0", f"out={tmp_path / 'c'}"], "greater than or equal to 1"),
        (["run", "algorithm=[1]"], "unknown algorithm"),
        (["run", "out=~/x", "dataset=digits", "data_dir=/tmp"], "data_dir=/tmp does not apply"),
    ]:
        refused(capsys, args, message)
    assert not (tmp_path / "c").exists()
    from splitlab.resolve import resolve_config

    assert resolve_config({"out": "~/x"}).out_dir == tmp_path / "home" / "x"
