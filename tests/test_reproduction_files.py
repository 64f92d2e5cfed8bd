"""The reproduction-suite sweep files (experiments/**/*.yaml) stay valid: every grid point expands
and passes the run-config validator, each file says what it is, and the CPU ones need no download.
Nothing trains here: building or running an experiment fails the test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import splitlab.engine
from splitlab.experiments import expand_sweep

ROOT = Path(__file__).resolve().parents[1]
SWEEP_FILES = sorted((ROOT / "experiments").rglob("*.yaml"))
CPU_FILES = [p for p in SWEEP_FILES if p.parent.name == "cpu"]
# the plays come from data/ (make setup), breast_cancer with scikit-learn
OFFLINE_DATASETS = {"fashion_mnist", "digits", "synthetic", "shakespeare", "shakespeare_lm", "breast_cancer"}


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT / "experiments")) for p in paths]


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("expand_sweep must not build or run an experiment")

    monkeypatch.setattr(splitlab.engine, "run", refuse)
    monkeypatch.setattr(splitlab.engine, "build", refuse)


def test_the_suite_is_there():
    names = set(_ids(SWEEP_FILES))
    for paper in ("cut_layer", "fsl_sage", "cyclesl", "splitgp"):
        assert {f"cpu/{paper}.yaml", f"paper/{paper}.yaml"} <= names


@pytest.mark.parametrize("path", SWEEP_FILES, ids=_ids(SWEEP_FILES))
def test_sweep_file_expands_and_describes_itself(path: Path, tmp_path: Path):
    spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    description = spec.get("description")
    assert isinstance(description, str) and description.strip(), f"{path.name}: no description"
    runs = expand_sweep(path, out=tmp_path / "sweep")
    assert runs, f"{path.name}: empty grid"
    assert len({name for name, _ in runs}) == len(runs)
    sweep_dir = tmp_path / "sweep"
    assert not sweep_dir.exists() or not any(sweep_dir.iterdir()), "expand_sweep wrote files"


#: files a script in experiments/ writes: dataset -> (data_dir, the script)
GENERATED = {"e2e": ("data/e2e_synthetic", "experiments/e2e_synthetic.py")}


@pytest.mark.parametrize("path", CPU_FILES, ids=_ids(CPU_FILES))
def test_cpu_files_use_offline_datasets_only(path: Path, tmp_path: Path):
    configs = [config for _, config in expand_sweep(path, out=tmp_path)]
    datasets = {config.get("dataset", "fashion_mnist") for config in configs}
    assert datasets <= OFFLINE_DATASETS | set(GENERATED), f"{path.name} needs {sorted(datasets - OFFLINE_DATASETS)}"
    for config in configs:
        generated = GENERATED.get(config.get("dataset", "fashion_mnist"))
        assert config.get("data_dir") == (generated[0] if generated else None)
        assert generated is None or generated[1] in path.read_text(encoding="utf-8"), "say how the files are made"


def test_the_synthetic_e2e_files_are_what_dataset_e2e_reads(tmp_path: Path):
    """experiments/e2e_synthetic.py writes the release's three files, with several references per
    test meaning representation, in E2E's slot notation; model=gpt reads them by characters."""
    import importlib.util

    from splitlab.data import load_dataset

    spec = importlib.util.spec_from_file_location("e2e_synthetic", ROOT / "experiments" / "e2e_synthetic.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.write(tmp_path, train=20, test=4, seed=0)
    data = load_dataset("e2e", tmp_path, seq_len=192)
    assert data.train_x.shape == (40, 192) and data.test_x.shape == (12, 192)
    assert data.references is not None and [len(refs) for refs in data.references.texts] == [3, 3, 3, 3]
    for prompt in data.references.prompts:  # the separator " ||" reads as spaces: | is not a LEAF character
        mr = data.references.tokenizer.decode(prompt)
        assert re.fullmatch(
            r"name\[[^]]+\](, (eatType|food|priceRange|customer rating|area|familyFriendly|near)"
            r"\[[^]]+\]){2,3}   ",
            mr,
        ), mr
    assert all(refs[0] != refs[1] or refs[1] != refs[2] for refs in data.references.texts)


def test_vertical_experiment_pairs_every_vertical_run_with_vanilla_sl_at_the_same_cut(tmp_path: Path):
    """Each 2-party vertical point has a vanilla twin (one client, every feature) that differs only in how the
    features are held, so REPRODUCTION.md's comparison is like with like."""
    runs = [config for _, config in expand_sweep(ROOT / "experiments/cpu/vertical.yaml", out=tmp_path)]
    vertical = [c for c in runs if c["setting"] == "vertical"]
    vanilla = [c for c in runs if c["setting"] == "vanilla"]
    assert len(vertical) == len(vanilla) > 0
    assert {c["dataset"] for c in vertical} == {"breast_cancer", "fashion_mnist"}
    party_keys = {"setting", "parties", "combine", "clients", "out"}
    for config in vertical:
        assert config["parties"] == 2 and config["algorithm"] == "sl"
        twin = [
            c
            for c in vanilla
            if {k: v for k, v in c.items() if k not in party_keys}
            == {k: v for k, v in config.items() if k not in party_keys}
        ]
        assert len(twin) == 1 and twin[0]["clients"] == 1
