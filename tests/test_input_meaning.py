"""Inputs checked for meaning, and each class of malformed input one line (exit 2) before anything
is written: JSON nested too deep or malformed (with its position), bytes that are not UTF-8 (their
line and offset in the file), folders given as files, damaged or non-finite safetensors files
wherever one is read, text outside model=gpt's characters, numbers that are not finite, noise
scales past their limit; a diverged run under a defense names it; `run` puts back the caller's
random states."""

from __future__ import annotations

import json
import random
import re
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from splitlab.algorithms.sfl_v2 import SFLV2
from splitlab.cli import main
from splitlab.codec import read_header, read_tensors
from splitlab.config import RunConfig
from splitlab.data.e2e import read_pairs
from splitlab.data.tables import read_table
from splitlab.engine import run
from splitlab.errors import NonFiniteLoss, UserError
from splitlab.json_text import user_json
from splitlab.loop import _check_finite
from splitlab.models.staged import StagedModel
from splitlab.settings.horizontal import check_split

TINY = ["model=gpt", "layers=1", "heads=1", "width=8", "context=16", "seq_len=8", "device=cpu", "--no-progress"]
ROWS = "".join(json.dumps({"text": f"to be or not to be, {i} times"}) + "\n" for i in range(12))


def refused(capsys, tmp_path, *args: str, match: str) -> None:
    """`splitlab ARGS out=...` ends with one line naming `match`, exit 2, and no run folder."""
    out = tmp_path / "out"
    assert main([*args, f"out={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err, err
    assert not out.exists()


def jsonl_run(tmp_path, *args: str) -> list[str]:
    return ["run", "dataset=jsonl", *TINY, *args]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    folder = tmp_path_factory.mktemp("finished")
    (folder / "rows.jsonl").write_text(ROWS)
    config = dict(arg.split("=", 1) for arg in TINY if "=" in arg)
    summary = run(
        dict(config, dataset="jsonl", data_file=str(folder / "rows.jsonl"), algorithm="centralized", clients=1,
             rounds=1, batch_size=4, out=str(folder / "run")),
        progress=False,
    )  # fmt: skip
    assert summary["rounds_completed"] == 1
    return folder / "run"


def test_json_too_deep_or_malformed_is_one_line_with_its_position(tmp_path, capsys):
    data = tmp_path / "deep.jsonl"
    data.write_text('{"text": "to be"}\n' + "[" * 200_000 + "]" * 200_000 + "\n")
    refused(capsys, tmp_path, *jsonl_run(tmp_path, f"data_file={data}"), match="deep.jsonl, line 2: nested deeper")
    nested = user_json("[" * 100 + "]" * 100, "f")  # 100 levels are read
    for _ in range(99):
        nested = nested[0]
    assert nested == []
    with pytest.raises(UserError, match="f: nested deeper than 100 levels"):
        user_json('{"a": ' * 101 + "1" + "}" * 101, "f")
    assert user_json('{"a": "' + "[" * 500 + '"}', "f") == {"a": "[" * 500}  # brackets in strings do not nest
    with pytest.raises(UserError, match=r"config.json: not valid JSON \(Expecting ',' delimiter at line 3, column 2\)"):
        user_json('{\n "a": 1\n "b": 2}', "config.json")
    with pytest.raises(UserError, match=r"l: not valid JSON \(Expecting value at column 7\)"):
        user_json('{"a": }', "l")
    deep_yaml = tmp_path / "deep.yaml"
    deep_yaml.write_text("a: " + "[" * 101 + "]" * 101 + "\n")
    refused(capsys, tmp_path, "run", "--config", str(deep_yaml), match="deep.yaml': nested deeper than 100 levels")


def test_a_byte_that_is_not_utf8_is_named_by_its_line_and_offset_in_the_file(tmp_path, capsys):
    lines = ROWS.encode() * 200  # 2,400 lines, past any reader's chunk
    data = tmp_path / "latin.jsonl"
    data.write_bytes(lines + b'{"text": "caf\xe9"}\n')
    offset = len(lines) + len(b'{"text": "caf')
    refused(
        capsys, tmp_path, *jsonl_run(tmp_path, f"data_file={data}"),
        match=f"latin.jsonl, line 2401: not UTF-8 text (invalid continuation byte at byte {offset} of the file)",
    )  # fmt: skip
    csv = tmp_path / "trainset.csv"  # E2E's files and CSV tables alike
    csv.write_bytes(b'mr,ref\n"name[A]","caf\xe9"\n')
    where = "line 2: not UTF-8 text (invalid continuation byte at byte 21 of the file)"
    with pytest.raises(UserError, match=re.escape(f"{csv}, {where}")):
        read_pairs(csv)
    with pytest.raises(UserError, match=re.escape(f"CSV file {str(csv)!r}, {where}")):
        read_table(csv)


def test_a_folder_given_as_a_file_is_called_a_folder(tmp_path, capsys):
    refused(capsys, tmp_path, *jsonl_run(tmp_path, f"data_file={tmp_path}"), match="is a folder, not a file")
    (tmp_path / "rows.jsonl").write_text(ROWS)
    refused(
        capsys, tmp_path, *jsonl_run(tmp_path, f"data_file={tmp_path / 'rows.jsonl'}", f"test_file={tmp_path}"),
        match=f"test_file={tmp_path}: is a folder, not a file",
    )  # fmt: skip


def test_text_outside_model_gpts_characters_is_refused_past_a_limit_and_warned_below(tmp_path, capsys, caplog):
    cyrillic = tmp_path / "cyrillic.jsonl"
    cyrillic.write_text("".join(json.dumps({"text": "быть или не быть"}) + "\n" for _ in range(12)))
    refused(
        capsys, tmp_path, *jsonl_run(tmp_path, f"data_file={cyrillic}"),
        match="cyrillic.jsonl, line 1: 156 of 192 characters (81.2%) are outside model=gpt's characters, most often "
        "'б' (24), 'ы' (24), 'т' (24), 'ь' (24), 'и' (24), and would train as spaces",
    )  # fmt: skip
    pairs = tmp_path / "pairs.jsonl"  # prompts and completions both count
    pairs.write_text("".join(json.dumps({"prompt": "to be", "completion": "не"}) + "\n" for _ in range(12)))
    refused(capsys, tmp_path, *jsonl_run(tmp_path, f"data_file={pairs}"), match="24 of 84 characters (28.6%)")
    curly = tmp_path / "curly.jsonl"  # one curly quote: below 1%
    curly.write_text(ROWS.replace("to be,", "to be\u2019", 1))  # 12 rows of 26 characters and their numbers
    out = tmp_path / "curly_run"
    assert main([*jsonl_run(tmp_path, f"data_file={curly}"), "rounds=1", "clients=2", f"out={out}"]) == 0
    assert "1 of 326 characters (0.3%) are outside model=gpt's characters ('\u2019' (1)): they train as spaces" in (
        caplog.text
    )


def test_damaged_or_non_finite_safetensors_are_one_line_wherever_read(finished, tmp_path, capsys):
    weights = finished / "weights.safetensors"
    data = weights.read_bytes()
    cases = {
        "truncated": (data[: len(data) // 2], "incomplete metadata, file not fully covered"),
        "header": (data[:3] + b"\xff" + data[4:], "header too large"),
        "empty": (b"", "Error while deserializing header"),
    }
    tensors = load_file(weights)
    tensors[next(iter(tensors))][0] = float("nan")
    save_file(tensors, tmp_path / "nan.safetensors")
    cases["nan"] = ((tmp_path / "nan.safetensors").read_bytes(), "holds non-finite values (")
    for name, (content, match) in cases.items():
        damaged = tmp_path / name
        damaged.mkdir()
        for file in finished.iterdir():
            if file.is_file():
                (damaged / file.name).write_bytes(file.read_bytes())
        (damaged / "weights.safetensors").write_bytes(content)
        with pytest.raises(UserError, match=re.escape(match)):
            read_tensors(damaged / "weights.safetensors")
        assert main(["generate", str(damaged), "prompt=to be", "max_new_tokens=2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and match in err, err
        rows = finished.parent / "rows.jsonl"
        refused(capsys, tmp_path, *jsonl_run(tmp_path, f"data_file={rows}", f"init={damaged}"), match=match)
    with pytest.raises(UserError, match="Error while deserializing header"):
        read_header(tmp_path / "empty" / "weights.safetensors")
    assert read_header(weights)[0] == {name: tuple(t.shape) for name, t in load_file(weights).items()}


def test_numbers_that_are_not_finite_and_noise_past_its_limit_are_named(tmp_path, capsys):
    for value in ("nan", "inf", "-inf", "1e400"):
        refused(
            capsys, tmp_path, "run", f"lr={value}", match=f"invalid value {value} for lr: it must be a finite number"
        )
    refused(capsys, tmp_path, "run", "eval_temperature=nan", match="eval_temperature: it must be a finite number")
    refused(capsys, tmp_path, "run", "lr=2e6", match="Input should be less than or equal to")  # finite: its bound
    for defense in ("noise:1e308", "gradnoise:1e7"):
        refused(capsys, tmp_path, "run", f"defense={defense}", match="<scale in [0, 1e6]>" if "grad" in defense
                else "<sigma in [0, 1e6]>")  # fmt: skip


def test_a_diverged_run_names_its_defense_where_it_has_one():
    with pytest.raises(NonFiniteLoss, match=r"became nan in round 2: training diverged; lower lr \(or use optimizer"):
        _check_finite(float("nan"), "training loss", 2, "none")
    with pytest.raises(NonFiniteLoss, match="became inf in round 1: training diverged; weaken defense=noise:1e6 or"):
        _check_finite(float("inf"), "training loss", 1, "noise:1e6")
    _check_finite(1.5, "training loss", 1, "noise:1e6")


def test_a_part_without_parameters_is_not_blamed_on_lora_without_lora():
    model = StagedModel(OrderedDict(flat=nn.Flatten(), fc=nn.Linear(4, 2)))
    with pytest.raises(UserError, match=r"^cut=1 leaves the client part nothing to train \(it holds no trainable "
                       r"parameters\)$"):  # fmt: skip
        check_split(model, RunConfig(cut=1), SFLV2)


def test_run_puts_back_the_callers_random_states(tmp_path):
    (tmp_path / "rows.jsonl").write_text(ROWS)
    config = dict(arg.split("=", 1) for arg in TINY if "=" in arg)
    config |= dict(dataset="jsonl", data_file=str(tmp_path / "rows.jsonl"), rounds=1, clients=2, batch_size=4)

    def draws() -> tuple:
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]

    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    expected = draws()
    torch.manual_seed(7), np.random.seed(7), random.seed(7)
    run(dict(config, out=str(tmp_path / "run")), progress=False)
    assert draws() == expected
