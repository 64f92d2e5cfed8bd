"""Fetching Fashion-MNIST from its official mirror, for machines without the Debian package.

Only on request (`splitlab download fashion_mnist`): runs never reach for the network by
themselves. Files land in the user cache, which the loader searches after the system copy.
"""

from __future__ import annotations

import gzip
import os
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from splitlab.data.idx import parse_idx
from splitlab.errors import UserError
from splitlab.io import write_bytes

FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


def cache_dir() -> Path:
    """`$XDG_CACHE_HOME/splitlab` (default ~/.cache/splitlab)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "splitlab"


def download_fashion_mnist(dest: Path | None = None, base_url: str = FASHION_MNIST_URL) -> Path:
    """Download the four gzipped IDX files into `dest` (default: the cache); returns the folder.

    Files already present are kept. Each file is checked (magic number, sizes) before it is
    moved into place, so an interrupted download never leaves a file the loader would trust.
    """
    dest = Path(dest) if dest is not None else cache_dir() / "fashion_mnist"
    for name in FASHION_MNIST_FILES:
        target = dest / name
        if target.is_file():
            continue
        url = base_url.rstrip("/") + "/" + name
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                payload = response.read()
        except (urllib.error.URLError, OSError) as err:
            raise UserError(
                f"could not download {url}: {getattr(err, 'reason', err)}; without a network, "
                f"install 'dataset-fashion-mnist' or pass data_dir=DIR with the four files"
            ) from None

        try:
            parse_idx(gzip.decompress(payload), 3 if "images" in name else 1, url)
        except (OSError, EOFError, zlib.error) as err:
            raise UserError(f"{url} is not a gzipped IDX file: {err}") from None
        write_bytes(target, payload)
    return dest
