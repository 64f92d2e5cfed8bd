"""The IDX format of MNIST and Fashion-MNIST, parsed with every header field checked: what the
loaders read and what `download` checks a fetched file with, below both."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from splitlab.errors import UserError


def parse_idx(raw: bytes, ndim: int, path: Path | str) -> np.ndarray:
    """Parse uncompressed IDX bytes (`path` names the source in errors).

    The magic number is 0x000008NN (0x08 = unsigned byte, NN = number of dimensions), followed
    by NN big-endian uint32 sizes and the row-major data.
    """
    header = 4 + 4 * ndim
    magic = int.from_bytes(raw[:4], "big") if len(raw) >= 4 else None
    if magic != 0x800 + ndim:
        got = "none (file too short)" if magic is None else f"0x{magic:08x}"
        raise UserError(
            f"{path} is not a uint8 IDX file with {ndim} dimension(s): magic number {got}, "
            f"expected 0x{0x800 + ndim:08x}"
        )
    if len(raw) < header:
        raise UserError(f"IDX file {path} is truncated inside its header")
    dims = tuple(int(d) for d in np.frombuffer(raw, ">u4", ndim, offset=4))
    if len(raw) - header != int(np.prod(dims)):
        raise UserError(
            f"IDX file {path} has {len(raw) - header} data bytes but its header says {dims} "
            f"= {int(np.prod(dims))} (truncated or corrupt)"
        )
    return np.frombuffer(raw, np.uint8, offset=header).reshape(dims)
