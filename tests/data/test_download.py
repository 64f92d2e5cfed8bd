"""Fetching Fashion-MNIST, served here from a file:// mirror the test writes (no network)."""

from __future__ import annotations

import pytest
from test_data import write_fashion

from splitlab.cli import main
from splitlab.data import load_dataset
from splitlab.data.download import FASHION_MNIST_FILES, download_fashion_mnist
from splitlab.errors import UserError


def test_download_then_load(tmp_path):
    mirror, dest = tmp_path / "mirror", tmp_path / "dest"
    write_fashion(mirror)
    assert download_fashion_mnist(dest, base_url=mirror.as_uri()) == dest
    assert sorted(p.name for p in dest.iterdir()) == sorted(FASHION_MNIST_FILES)
    assert len(load_dataset("fashion_mnist", data_dir=dest).train_y) == 20


def test_corrupt_download_is_refused_and_not_kept(tmp_path):
    mirror = tmp_path / "mirror"
    write_fashion(mirror)
    (mirror / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    with pytest.raises(UserError, match="t10k-labels-idx1-ubyte.gz is not a gzipped IDX file"):
        download_fashion_mnist(tmp_path / "dest", base_url=mirror.as_uri())
    assert not (tmp_path / "dest" / "t10k-labels-idx1-ubyte.gz").exists()


def test_unreachable_mirror_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    import splitlab.data.download as download

    monkeypatch.setattr(download.download_fashion_mnist, "__defaults__", (None, (tmp_path / "nowhere").as_uri()))
    assert main(["download", "fashion_mnist", "--dir", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not download") and err.count("\n") == 1
