"""Tests mirror the package (tests/algorithms, tests/data, ...); `helpers` is shared by all."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def token_cache(tmp_path_factory):
    """Tokenised corpora go to a folder of the session's, never to the user's cache (and reach the
    processes a test starts: servers, clients, Ray workers)."""
    folder = tmp_path_factory.mktemp("token-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPLITLAB_TOKEN_CACHE", str(folder))
        yield folder
