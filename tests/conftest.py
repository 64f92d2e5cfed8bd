"""Tests mirror the package (tests/algorithms, tests/data, ...); `helpers` is shared by all.

`make test` runs them in parallel workers (pytest-xdist, `-n 2 --dist loadgroup`): every test keeps
its files under tmp_path, picks free ports, and the tests that start Ray share one worker (their
modules are marked `xdist_group("ray")`); docs/architecture.md, "Tests"."""

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

#: One torch thread here and in every process a test starts (servers, clients: OMP_NUM_THREADS), as
#: launched processes and Ray actors compute: a run in the test's process then sums in their order
#: and compares bit for bit (with two threads, MLP runs differed from launched ones in the last bits
#: on the loaded 2-core machine), and two workers never run more threads than there are cores.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
torch.set_num_threads(1)
