"""Data layer: file loaders on tiny files written here in the exact on-disk formats, and the
partitioners' invariants (disjoint, sorted, covering, seeded, skewed as promised)."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import idx_bytes
from splitlab.data import (
    DATASETS,
    Dataset,
    dataset_availability,
    dataset_names,
    load_dataset,
    parse_partition_scheme,
    partition,
    partition_report,
)
from splitlab.data.datasets import FASHION_MNIST_SYSTEM_DIR, read_idx
from splitlab.errors import UserError

FASHION_FILES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


@pytest.fixture(autouse=True)
def _no_data_env(monkeypatch):
    monkeypatch.delenv("SPLITLAB_DATA", raising=False)


def one_line_error(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------------------------------------
# Fashion-MNIST / IDX


def write_fashion(folder: Path, gz: bool = True) -> dict[str, np.ndarray]:
    """20 train / 10 test 28x28 images; train image 3 has one white pixel at (5, 7)."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train_images": np.zeros((20, 28, 28), np.uint8),
        "train_labels": (np.arange(20) % 10).astype(np.uint8),
        "test_images": np.full((10, 28, 28), 51, np.uint8),
        "test_labels": np.arange(9, -1, -1).astype(np.uint8),
    }
    arrays["train_images"][3, 5, 7] = 255
    for key, name in FASHION_FILES.items():
        raw = idx_bytes(arrays[key])
        if gz:
            (folder / name).write_bytes(gzip.compress(raw))
        else:
            (folder / name.removesuffix(".gz")).write_bytes(raw)
    return arrays


def test_fashion_mnist_loader_on_tiny_idx_files(tmp_path):
    arrays = write_fashion(tmp_path)
    ds = load_dataset("fashion_mnist", data_dir=tmp_path)
    assert ds.train_x.shape == (20, 1, 28, 28) and ds.test_x.shape == (10, 1, 28, 28)
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64  # stored; inputs() scales
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10
    assert ds.train_y.tolist() == arrays["train_labels"].tolist()
    assert ds.test_y.tolist() == arrays["test_labels"].tolist()
    train_x, test_x = ds.inputs(ds.train_x), ds.inputs(ds.test_x)
    assert train_x.dtype == torch.float32
    assert train_x[3, 0, 5, 7].item() == pytest.approx((1.0 - 0.2860) / 0.3530, abs=1e-5)
    assert train_x[3, 0, 7, 5].item() == pytest.approx(-0.2860 / 0.3530, abs=1e-5)
    assert test_x[0, 0, 0, 0].item() == pytest.approx((0.2 - 0.2860) / 0.3530, abs=1e-5)


def test_fashion_mnist_inputs_are_bit_identical_to_the_float32_pipeline(tmp_path):
    """Per-batch preparation of the stored uint8 pixels gives exactly the float32 values the loader
    used to hold for the whole dataset (converted and normalized at load time)."""
    write_fashion(tmp_path)
    images = np.random.default_rng(0).integers(0, 256, (20, 28, 28), dtype=np.uint8)
    (tmp_path / FASHION_FILES["train_images"]).write_bytes(gzip.compress(idx_bytes(images)))
    ds = load_dataset("fashion_mnist", data_dir=tmp_path)
    before = torch.from_numpy(images.astype(np.float32)).unsqueeze(1)
    before.div_(255.0).sub_(0.2860).div_(0.3530)
    assert torch.equal(ds.inputs(ds.train_x), before)
    assert torch.equal(torch.cat([ds.inputs(ds.train_x[i : i + 3]) for i in range(0, 20, 3)]), before)


def test_fashion_mnist_accepts_uncompressed_files_in_a_subfolder(tmp_path):
    write_fashion(tmp_path / "fashion_mnist", gz=False)
    ds = load_dataset("fashion_mnist", data_dir=tmp_path)
    assert len(ds.train_y) == 20 and len(ds.test_y) == 10


def test_fashion_mnist_env_var_is_searched_before_the_system_copy(tmp_path, monkeypatch):
    write_fashion(tmp_path / "fashion_mnist")
    monkeypatch.setenv("SPLITLAB_DATA", str(tmp_path))
    assert len(load_dataset("fashion_mnist").train_y) == 20


@pytest.mark.parametrize(
    "corrupt, expected",
    [
        (lambda raw: b"\x00\x00\x08\x01" + raw[4:], "magic number 0x00000801"),  # labels magic
        (lambda raw: raw[:-5], "truncated or corrupt"),
        (lambda raw: raw[:2], "magic number none"),
    ],
    ids=["wrong-magic", "truncated-data", "truncated-header"],
)
def test_corrupt_idx_file_is_a_user_error_naming_the_file(tmp_path, corrupt, expected):
    write_fashion(tmp_path, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(UserError) as excinfo:
        load_dataset("fashion_mnist", data_dir=tmp_path)
    msg = one_line_error(excinfo)
    assert str(path) in msg and expected in msg


def test_read_idx_gzipped_and_broken_gzip(tmp_path):
    good = tmp_path / "good.gz"
    good.write_bytes(gzip.compress(idx_bytes(np.arange(6, dtype=np.uint8).reshape(2, 3))))
    assert read_idx(good, 2).tolist() == [[0, 1, 2], [3, 4, 5]]
    bad = tmp_path / "bad.gz"
    bad.write_bytes(good.read_bytes()[:-6])
    with pytest.raises(UserError, match="cannot read IDX file .*bad.gz"):
        read_idx(bad, 2)


def test_fashion_mnist_missing_dir_says_where_and_how(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(UserError) as excinfo:
        load_dataset("fashion_mnist", data_dir=missing)
    msg = one_line_error(excinfo)
    assert "apt-get install dataset-fashion-mnist" in msg and str(missing) in msg


@pytest.mark.skipif(not FASHION_MNIST_SYSTEM_DIR.is_dir(), reason="dataset-fashion-mnist not installed")
def test_real_fashion_mnist():
    ds = load_dataset("fashion_mnist", data_dir=FASHION_MNIST_SYSTEM_DIR)
    assert ds.train_x.shape == (60000, 1, 28, 28) and ds.test_x.shape == (10000, 1, 28, 28)
    assert np.bincount(ds.train_y.numpy()).tolist() == [6000] * 10
    assert np.bincount(ds.test_y.numpy()).tolist() == [1000] * 10
    x = ds.inputs(ds.train_x)
    assert abs(x.mean().item()) < 0.01 and abs(x.std().item() - 1) < 0.01


# ---------------------------------------------------------------------------------------------
# CIFAR (binary version)


CIFAR = {
    # name: folder, train files, test file, label bytes, classes, mean, std
    "cifar10": (
        "cifar-10-batches-bin",
        [f"data_batch_{i}.bin" for i in range(1, 6)],
        "test_batch.bin",
        1,
        10,
        (0.4914, 0.4822, 0.4465),
        (0.2470, 0.2435, 0.2616),
    ),
    "cifar100": (
        "cifar-100-binary",
        ["train.bin"],
        "test.bin",
        2,
        100,
        (0.5071, 0.4865, 0.4409),
        (0.2673, 0.2564, 0.2762),
    ),
}
# the python version (pickled dicts), which splitlab refuses: folder, files
CIFAR_PICKLED = {
    "cifar10": ("cifar-10-batches-py", [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]),
    "cifar100": ("cifar-100-python", ["train", "test"]),
}


def cifar_records(labels: list[int], images: np.ndarray, coarse: list[int] | None = None) -> bytes:
    """Binary-version records: [coarse label byte] label byte, then 3072 pixel bytes (R, G, B planes)."""
    heads = np.array([labels] if coarse is None else [coarse, labels], np.uint8).T
    return np.concatenate([heads, images.reshape(len(labels), 3072)], axis=1).tobytes()


def write_cifar(parent: Path, name: str, seed: int = 0) -> tuple[Path, dict[str, tuple[np.ndarray, list[int]]]]:
    """Two random images per train file, three test images; labels 0, 7, 14, ... mod classes, and
    CIFAR-100 coarse labels fine % 20. Returns the folder and {file: (images (N, 3, 32, 32), labels)}."""
    folder_name, train_files, test_file, label_bytes, classes, _, _ = CIFAR[name]
    folder = parent / folder_name
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    written, label = {}, 0
    for file in [*train_files, test_file]:
        n = 3 if file == test_file else 2
        images = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        labels = [(label + 7 * i) % classes for i in range(n)]
        label += 7 * n
        coarse = [y % 20 for y in labels] if label_bytes == 2 else None
        (folder / file).write_bytes(cifar_records(labels, images, coarse))
        written[file] = (images, labels)
    (folder / ("batches.meta.txt" if name == "cifar10" else "fine_label_names.txt")).write_text("x\n")
    return folder, written


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("point_at", ["folder", "parent"])
def test_cifar_loader_layout_labels_and_values(tmp_path, name, point_at):
    folder, written = write_cifar(tmp_path, name)
    _, train_files, test_file, label_bytes, classes, mean, std = CIFAR[name]
    # a known pixel: channel 1 (G), row 5, column 9 of the last training image is 200, i.e. byte
    # label_bytes + 1 * 1024 + 5 * 32 + 9 of its record
    images, labels = written[train_files[-1]]
    images[-1, 1, 5, 9] = 200
    coarse = [y % 20 for y in labels] if label_bytes == 2 else None
    raw = bytearray(cifar_records(labels, images, coarse))
    assert raw[len(raw) // 2 + label_bytes + 1 * 1024 + 5 * 32 + 9] == 200
    (folder / train_files[-1]).write_bytes(bytes(raw))

    ds = load_dataset(name, data_dir=folder if point_at == "folder" else tmp_path)
    n_train = 2 * len(train_files)
    assert ds.train_x.shape == (n_train, 3, 32, 32) and ds.test_x.shape == (3, 3, 32, 32)
    assert ds.input_shape == (3, 32, 32) and ds.num_classes == classes
    assert ds.train_x.dtype == torch.uint8 and ds.train_y.dtype == torch.int64  # stored; inputs() scales
    assert ds.train_x.is_contiguous() and ds.test_x.is_contiguous()
    expected_train = np.concatenate([written[f][0] for f in train_files])
    assert np.array_equal(ds.train_x.numpy(), expected_train)
    assert np.array_equal(ds.test_x.numpy(), written[test_file][0])
    assert ds.train_y.tolist() == [(7 * i) % classes for i in range(n_train)]  # the fine labels
    assert ds.test_y.tolist() == [(7 * i) % classes for i in range(n_train, n_train + 3)]
    assert ds.train_x[-1, 1, 5, 9].item() == 200
    x = ds.inputs(ds.train_x)
    assert x.dtype == torch.float32
    assert x[-1, 1, 5, 9].item() == pytest.approx((200 / 255 - mean[1]) / std[1], abs=1e-5)
    # bit for bit the float32 values of converting the whole set at load time, as before
    before = torch.from_numpy(expected_train.astype(np.float32))
    before.div_(255.0).sub_(torch.tensor(mean).view(1, 3, 1, 1)).div_(torch.tensor(std).view(1, 3, 1, 1))
    assert torch.equal(x, before)


def test_cifar_is_found_under_the_data_root_env_var(tmp_path, monkeypatch):
    write_cifar(tmp_path, "cifar100")
    monkeypatch.setenv("SPLITLAB_DATA", str(tmp_path))
    assert len(load_dataset("cifar100").train_y) == 2


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_missing_file_is_named(tmp_path, name):
    folder, _ = write_cifar(tmp_path, name)
    victim = folder / CIFAR[name][2]
    victim.unlink()
    with pytest.raises(UserError) as excinfo:
        load_dataset(name, data_dir=tmp_path)
    msg = one_line_error(excinfo)
    assert str(victim) in msg and "binary version" in msg and "data_dir=DIR" in msg


def test_cifar_without_any_dir_says_how_to_get_it():
    with pytest.raises(UserError) as excinfo:
        load_dataset("cifar10")
    msg = one_line_error(excinfo)
    assert "looked nowhere" in msg and "binary version" in msg and "data_dir=DIR" in msg
    assert "cifar-10-batches-bin/" in msg and "data_batch_1.bin" in msg and "test_batch.bin" in msg


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("point_at", ["folder", "parent"])
def test_cifar_python_version_is_refused_unread(tmp_path, name, point_at):
    folder_name, files = CIFAR_PICKLED[name]
    folder = tmp_path / folder_name
    folder.mkdir()
    for file in files:  # protocol-2 pickles as in the real archive, written here and never loaded
        (folder / file).write_bytes(pickle.dumps({b"data": [], b"labels": []}, protocol=2))
    with pytest.raises(UserError) as excinfo:
        load_dataset(name, data_dir=folder if point_at == "folder" else tmp_path)
    msg = one_line_error(excinfo)
    assert str(folder) in msg and "pickle files that splitlab will not load" in msg
    assert all(f in msg for f in files) and "binary version" in msg and CIFAR[name][0] in msg


def test_cifar_binary_version_is_used_when_the_python_version_is_there_too(tmp_path):
    (tmp_path / "cifar-100-python").mkdir()
    for file in ("train", "test"):
        (tmp_path / "cifar-100-python" / file).write_bytes(pickle.dumps({}, protocol=2))
    folder, _ = write_cifar(tmp_path, "cifar100")
    assert dict(name="cifar100", available=True, where=str(folder)) in dataset_availability(tmp_path)
    assert len(load_dataset("cifar100", data_dir=tmp_path).test_y) == 3


@pytest.mark.parametrize(
    "name, file, corrupt, expected",
    [
        ("cifar10", "test_batch.bin", lambda raw: raw[:-1], "has 9218 bytes, not a whole number of 3073-byte"),
        ("cifar10", "data_batch_2.bin", lambda raw: raw + b"\0", "has 6147 bytes"),
        ("cifar10", "data_batch_5.bin", lambda raw: b"", "has 0 bytes"),
        ("cifar100", "train.bin", lambda raw: raw[:4611], "has 4611 bytes, not a whole number of 3074-byte"),
        ("cifar100", "test.bin", lambda raw: raw[:-1], "has 9221 bytes"),
        ("cifar10", "data_batch_3.bin", lambda raw: b"\x0a" + raw[1:], "has label 10 in record 0; labels are 0..9"),
        ("cifar10", "test_batch.bin", lambda raw: raw[:6146] + b"\xff" + raw[6147:], "label 255 in record 2"),
        (
            "cifar100",
            "test.bin",
            lambda raw: raw[:3075] + b"\x64" + raw[3076:],
            "label 100 in record 1; labels are 0..99",
        ),
        (
            "cifar100",
            "train.bin",
            lambda raw: b"\x14" + raw[1:],
            "coarse label 20 in record 0; coarse labels are 0..19",
        ),
    ],
    ids=[
        "truncated",
        "extra-byte",
        "empty",
        "cifar100-half-a-record",
        "cifar100-one-byte-short",
        "label-10",
        "label-255-last-record",
        "fine-label-100",
        "coarse-label-20",
    ],
)
def test_bad_cifar_file_is_a_one_line_error_naming_it(tmp_path, name, file, corrupt, expected):
    folder, _ = write_cifar(tmp_path, name)
    path = folder / file
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(UserError) as excinfo:
        load_dataset(name, data_dir=folder)
    msg = one_line_error(excinfo)
    assert str(path) in msg and expected in msg


# ---------------------------------------------------------------------------------------------
# Built-in datasets and the registry


def test_digits_split_is_stratified_normalized_and_seeded():
    a, b, c = load_dataset("digits", seed=0), load_dataset("digits", seed=0), load_dataset("digits", seed=1)
    assert a.train_x.shape == (1437, 1, 8, 8) and a.test_x.shape == (360, 1, 8, 8)
    assert a.train_x.dtype == torch.float32 and a.train_y.dtype == torch.int64
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10
    assert torch.equal(a.train_x, b.train_x) and not torch.equal(a.train_x, c.train_x)
    assert abs(a.train_x.mean().item()) < 1e-4 and abs(a.train_x.std().item() - 1) < 1e-3
    test_counts = np.bincount(a.test_y.numpy())
    assert test_counts.min() >= 35 and test_counts.max() <= 37  # 20% of ~180 per class


def test_synthetic_is_deterministic_by_seed():
    a, b, c = (load_dataset("synthetic", seed=s) for s in (3, 3, 4))
    assert a.train_x.shape == (1200, 1, 8, 8) and a.test_x.shape == (300, 1, 8, 8)
    assert a.train_y.dtype == torch.int64 and a.num_classes == 10
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)
    assert not torch.equal(a.train_x, c.train_x)
    assert np.bincount(a.train_y.numpy()).tolist() == [120] * 10


def test_unknown_dataset_lists_the_available_ones():
    with pytest.raises(UserError) as excinfo:
        load_dataset("mnistt")
    assert one_line_error(excinfo) == (
        "unknown dataset 'mnistt'; available: breast_cancer, celeba, cifar10, cifar100, csv, digits, e2e, "
        "fashion_mnist, femnist, hf_disk, jsonl, shakespeare, shakespeare_lm, synthetic"
    )
    assert dataset_names() == sorted(DATASETS)


def test_loading_twice_is_cached():
    assert load_dataset("synthetic", seed=5) is load_dataset("synthetic", seed=5)


def test_availability_reports_found_missing_and_registry_only_datasets(tmp_path, monkeypatch):
    folder, _ = write_cifar(tmp_path, "cifar10")

    def broken(data_dir, seed):
        raise UserError("toy needs toy.bin")

    monkeypatch.setitem(DATASETS, "toy", broken)
    rows = {r["name"]: r for r in dataset_availability(tmp_path)}
    assert sorted(rows) == dataset_names()
    assert rows["cifar10"] == {"name": "cifar10", "available": True, "where": str(folder)}
    assert rows["cifar100"]["available"] is False and "CIFAR-100" in rows["cifar100"]["where"]
    assert rows["digits"]["available"] is True and rows["synthetic"]["available"] is True
    assert rows["toy"] == {"name": "toy", "available": False, "where": "toy needs toy.bin"}


def test_dataset_rejects_mismatched_tensors():
    x, y = torch.zeros(4, 1, 2, 2), torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="train split is malformed"):
        Dataset("bad", x, y, x, y[:4], 2, (1, 2, 2))


# ---------------------------------------------------------------------------------------------
# Partitioners


def balanced_labels(n_per_class: int = 100, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), n_per_class))


def mean_label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    entropies = []
    for p in parts:
        q = np.bincount(labels[p], minlength=10) / len(p)
        q = q[q > 0]
        entropies.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(entropies))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.5", "shards:2"])
def test_partition_is_disjoint_sorted_covering_and_seeded(scheme):
    labels = balanced_labels()
    parts = partition(labels, 10, scheme, seed=0)
    assert len(parts) == 10
    for p in parts:
        assert p.dtype == np.int64 and len(p) >= 1 and np.all(np.diff(p) > 0)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(labels)))
    again = partition(labels, 10, scheme, seed=0)
    other = partition(labels, 10, scheme, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


@pytest.mark.parametrize("scheme", ["iid", "dirichlet:0.3"])
def test_one_client_gets_everything_in_order(scheme):
    labels = balanced_labels(7)
    (only,) = partition(labels, 1, scheme, seed=3)
    assert np.array_equal(only, np.arange(len(labels)))


def test_iid_sizes_differ_by_at_most_one():
    sizes = [len(p) for p in partition(balanced_labels(), 7, "iid", seed=0)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 1000


def test_dirichlet_small_alpha_is_more_skewed():
    labels = balanced_labels()
    skewed = mean_label_entropy(labels, partition(labels, 10, "dirichlet:0.1", seed=0))
    flat = mean_label_entropy(labels, partition(labels, 10, "dirichlet:100", seed=0))
    assert skewed < 1.2 < 2.1 < flat  # log(10) = 2.30 is perfectly balanced


def test_dirichlet_that_cannot_fill_every_client_says_what_to_do():
    with pytest.raises(UserError, match="fewer clients or a larger alpha"):
        partition(balanced_labels(2, 2), 4, "dirichlet:0.001", seed=0)


def test_shards_give_each_client_s_label_pure_shards():
    labels = balanced_labels()  # 100 per class; 10 clients x 2 shards of 50: shards are label-pure
    parts = partition(labels, 10, "shards:2", seed=0)
    for p in parts:
        assert len(p) == 2 * 50 and len(np.unique(labels[p])) <= 2
        assert all(c % 50 == 0 for c in np.bincount(labels[p]))


def test_shards_drop_the_remainder_when_not_divisible():
    labels = balanced_labels()[:997]  # 997 // (4 * 3) = 83 per shard, 1 left over
    parts = partition(labels, 4, "shards:3", seed=0)
    assert [len(p) for p in parts] == [3 * 83] * 4
    assert len(np.unique(np.concatenate(parts))) == 996


@pytest.mark.parametrize(
    "scheme",
    [
        "dirichlet:0",
        "dirichlet:-1",
        "dirichlet:x",
        "dirichlet:nan",
        "dirichlet",
        "shards:0",
        "shards:1.5",
        "shards:",
        "foo",
        "iid:2",
        "",
    ],
)
def test_bad_schemes_are_user_errors(scheme):
    with pytest.raises(UserError) as excinfo:
        partition(balanced_labels(), 5, scheme, seed=0)
    msg = one_line_error(excinfo)
    assert repr(scheme) in msg and "dirichlet:<alpha>" in msg and "shards:<" in msg


def test_parse_partition_scheme_values():
    assert parse_partition_scheme("iid") == ("iid", None)
    assert parse_partition_scheme("dirichlet:0.5") == ("dirichlet", 0.5)
    assert parse_partition_scheme("shards:2") == ("shards", 2)


@pytest.mark.parametrize(
    "n, clients, scheme, numbers",
    [(5, 6, "iid", ["6", "5"]), (20, 0, "iid", ["0"]), (10, 3, "shards:4", ["12", "10", "3"])],
)
def test_too_many_clients_is_a_user_error(n, clients, scheme, numbers):
    with pytest.raises(UserError) as excinfo:
        partition(np.zeros(n, np.int64), clients, scheme, seed=0)
    msg = one_line_error(excinfo)
    assert all(num in msg for num in numbers)


def test_partition_report_counts_sum_to_sizes():
    labels = balanced_labels()
    parts = partition(labels, 6, "dirichlet:0.5", seed=2)
    report = partition_report(labels, parts, 10)
    assert json.loads(json.dumps(report)) == report
    assert report["num_clients"] == 6 and report["num_classes"] == 10
    assert report["sizes"] == [len(p) for p in parts]
    assert [sum(c) for c in report["counts"]] == report["sizes"]
    assert np.sum(report["counts"], axis=0).tolist() == [100] * 10
    assert all(type(v) is int for row in report["counts"] for v in row)
