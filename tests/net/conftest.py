"""The `servers` fixture: `splitlab server` processes, killed at the end of the test if still running."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from processes import Server


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
