"""`pretrain:` in a sweep file: one run made first, from whose model every grid point starts
(init), and `train_range`, which gives the pretraining and the fine-tuning disjoint data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.torch import load_file

from splitlab.assembly import load_data
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.experiments import run_sweep
from splitlab.resolve import resolve_config
from splitlab.settings.horizontal import client_indices


def _spec(lm: dict) -> dict:
    common = {**lm, "rounds": 1, "local_steps": 1, "test_subset": 16}
    return {
        "pretrain": {**common, "algorithm": "centralized", "train_range": "0:0.5"},
        "base": {**common, "cut": 1, "lora": "2:4", "train_range": "0.5:1"},
        "axes": {"algorithm": ["sfl_v2"]},
    }


def test_train_range_picks_disjoint_stretches_in_the_dataset_s_order(lm):
    def pool(value: str) -> np.ndarray:
        config = resolve_config({**lm, "train_range": value})
        return np.sort(np.concatenate(client_indices(config, load_data(config))))

    first, rest = pool("0:0.5"), pool("0.5:1")
    everything = pool("0:1")
    assert first.max() < rest.min() and np.array_equal(np.concatenate([first, rest]), everything)
    assert len(first) == round(0.5 * len(everything))
    for bad in ("0.5:0.2", "0:1.5", "half", "-0.1:0.5"):
        with pytest.raises(UserError, match="expected A:B with fractions 0 <= A < B <= 1"):
            resolve_config({**lm, "train_range": bad})


def test_a_sweep_pretrains_first_and_every_run_starts_from_that_model(lm, tmp_path: Path):
    spec = _spec(lm)
    path = tmp_path / "pre.yaml"
    path.write_text(yaml.safe_dump(spec))
    sweep = run_sweep(path, out=tmp_path / "sweep", progress=False)
    name = "algorithm=sfl_v2"
    stored = yaml.safe_load((sweep / name / "config.yaml").read_text())
    assert stored["init"] == str(sweep / "pretrain") and stored["train_range"] == "0.5:1"
    assert (sweep / "pretrain" / "summary.json").is_file()
    by_hand = {**spec["base"], "algorithm": "sfl_v2", "init": str(sweep / "pretrain"), "out": str(tmp_path / "hand")}
    run(by_hand, progress=False)
    swept, reference = (
        load_file(sweep / name / "weights.safetensors"),
        load_file(tmp_path / "hand" / "weights.safetensors"),
    )
    assert swept.keys() == reference.keys() and all((swept[k] == reference[k]).all() for k in swept)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pretrain": {"out": "x"}}, "pretrain.out is set by the sweep"),
        ({"base": {"init": "elsewhere"}}, "'init' is set by 'pretrain'"),
        ({"pretrain": None}, "'pretrain' must be a non-empty mapping"),
        ({"pretrain": {"rounds": 0}}, "pretrain: "),
    ],
)
def test_bad_pretrain_sections_are_refused_in_one_line(lm, tmp_path: Path, change, message):
    spec = _spec(lm)
    for section, keys in change.items():
        spec[section] = ["not", "a mapping"] if keys is None else {**spec[section], **keys}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=message):
        run_sweep(path, out=tmp_path / "sweep", progress=False)
    assert not (tmp_path / "sweep" / "pretrain").exists()
