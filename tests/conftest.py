"""Tests mirror the package (tests/algorithms, tests/data, ...); `helpers` is shared by all.

`make test` runs them in parallel workers (pytest-xdist, `-n 2 --dist loadgroup`): every test keeps
its files under tmp_path, picks free ports, and the tests that start Ray share one worker (their
modules are marked `xdist_group("ray")`)."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

#: Tokenised corpora go to a folder of this process's (one per worker), never to the user's cache.
#: Set on import, before test modules copy os.environ for the processes they start (servers, clients, Ray).
TOKEN_CACHE = tempfile.mkdtemp(prefix="splitlab-token-cache-")
os.environ["SPLITLAB_TOKEN_CACHE"] = TOKEN_CACHE
atexit.register(shutil.rmtree, TOKEN_CACHE, ignore_errors=True)

#: Workers share the cores: each computes with its share, and so do the processes it starts, so that
#: two workers never run more threads than there are cores.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if WORKERS > 1:
    THREADS = max(1, (os.cpu_count() or 1) // WORKERS)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(THREADS)
    torch.set_num_threads(THREADS)
