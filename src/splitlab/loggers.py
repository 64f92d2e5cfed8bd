"""Optional metric loggers beside metrics.jsonl (which is always written).

`logger=tensorboard` writes each evaluated round's metrics under OUT/tensorboard when the
`tensorboard` package is installed (`pip install tensorboard`); it is not a dependency.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from splitlab.comm import GIB, format_bytes
from splitlab.errors import UserError

SCALARS = ("test_accuracy", "test_loss", "test_f1", "test_mcc", "test_perplexity", "train_loss", "comm_gib")


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_logger(name: str) -> None:
    """Fail before anything is written when the chosen logger cannot work here."""
    if name == "tensorboard" and not installed("tensorboard"):
        raise UserError(
            "logger=tensorboard needs the tensorboard package (pip install tensorboard); "
            "use logger=none to log to metrics.jsonl only"
        )


class TensorBoardLogger:
    def __init__(self, out: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))

    def log(self, row: dict) -> None:
        for key in SCALARS:
            if row.get(key) is not None:
                self.writer.add_scalar(key, row[key], row["round"])
        for kind, nbytes in row["comm_bytes_by_kind"].items():
            self.writer.add_scalar(f"comm_gib/{kind}", nbytes / GIB, row["round"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class NoLogger:
    def log(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def make_logger(name: str, out: Path) -> TensorBoardLogger | NoLogger:
    return TensorBoardLogger(out) if name == "tensorboard" else NoLogger()


def round_line(row: dict, rounds: int) -> str:
    """One plain line per evaluated round, for output that is not a terminal."""
    return (
        f"round {row['round']}/{rounds}  acc {100 * row['test_accuracy']:.2f}%  "
        f"loss {row['test_loss']:.4f}  {format_bytes(row['comm_bytes'])}  {row['wall_seconds']:.1f} s"
    )
