"""Tests mirror the package (tests/algorithms, tests/data, ...); `helpers` is shared by all."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

#: Tokenised corpora go to a folder of the session's, never to the user's cache. Set on import,
#: before test modules copy os.environ for the processes they start (servers, clients, Ray).
TOKEN_CACHE = tempfile.mkdtemp(prefix="splitlab-token-cache-")
os.environ["SPLITLAB_TOKEN_CACHE"] = TOKEN_CACHE
atexit.register(shutil.rmtree, TOKEN_CACHE, ignore_errors=True)
