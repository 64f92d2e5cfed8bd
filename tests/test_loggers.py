"""logger=tensorboard: a clear error when the package is missing, the right scalars when present."""

from __future__ import annotations

import pytest

import splitlab.loggers as loggers
from helpers import quick
from splitlab.engine import run
from splitlab.errors import UserError


def test_missing_tensorboard_is_a_user_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setattr(loggers, "installed", lambda package: False)
    with pytest.raises(UserError, match="logger=tensorboard needs the tensorboard package"):
        run(quick(algorithm="sfl_v2", logger="tensorboard", out=str(tmp_path / "r")), progress=False)
    assert not (tmp_path / "r").exists()


class RecordingWriter:
    """Stands in for torch's SummaryWriter, which needs the tensorboard package."""

    def __init__(self):
        self.scalars, self.closed = [], False

    def add_scalar(self, key, value, step):
        self.scalars.append((key, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_every_evaluated_round_is_logged(tmp_path, monkeypatch):
    writer = RecordingWriter()
    monkeypatch.setattr(loggers, "installed", lambda package: True)
    monkeypatch.setattr(loggers.TensorBoardLogger, "__init__", lambda self, out: setattr(self, "writer", writer))
    run(quick(algorithm="sfl_v2", rounds=2, logger="tensorboard", out=str(tmp_path)), progress=False)
    assert writer.closed
    steps = {(key, step) for key, _, step in writer.scalars}
    for key in ("test_accuracy", "test_loss", "comm_gib", "comm_gib/smashed"):
        assert {(key, 1), (key, 2)} <= steps
