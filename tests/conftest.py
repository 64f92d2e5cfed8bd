"""Tests mirror the package (tests/algorithms, tests/data, ...); `helpers` is shared by all.

`make test` runs them in parallel workers (pytest-xdist, `-n 2`): every test keeps its files under
tmp_path and picks free ports; a module runs whole on one worker and the modules that start Ray
(tests/**/test_ray*.py) all on one (`pytest_xdist_make_scheduler` below), where they share one
local Ray (`local_ray`); docs/architecture.md, "Tests"."""

import atexit
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
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

#: Ray starts its worker processes (actors, tasks) at niceness 15, below the other test worker's
#: processes: on 2 busy cores its actors got a fraction of a core, and a Ray test waited on them
#: (the killed-worker sweep: 9 s alone, 47-57 s in a full run, 440 s beside two busy loops). The
#: tests' Ray processes compete as equals (Ray reads RAY_<setting> from the environment it starts in).
os.environ["RAY_worker_niceness"] = "0"  # noqa: SIM112 - Ray reads this exact name


def pytest_xdist_make_scheduler(config, log):
    """Each test module whole on one worker, so its module-scoped fixtures (trained runs, launched
    servers) are built once, not once per worker; the Ray modules together on one worker, so two Ray
    clusters never share the cores. (`--dist loadgroup` would do this by marks, but with pytest 9
    xdist's group suffix no longer reaches the node ids, so it splits groups silently.) The longest
    units go first, so that no worker is left with one at the end while the other idles: the Ray
    modules, then the modules that start servers and clients (tests/net), then the rest, most tests
    first."""
    from xdist.scheduler import LoadFileScheduling

    def first(scope: str) -> int:
        return 0 if scope == "ray" else 1 if Path(scope).parent.name == "net" else 2

    class ModulesRayTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "ray" if Path(module).name.startswith("test_ray") else module

        def _assign_work_unit(self, node) -> None:
            ordered = sorted(self.workqueue.items(), key=lambda unit: (first(unit[0]), -len(unit[1])))
            self.workqueue.clear()
            self.workqueue.update(ordered)
            super()._assign_work_unit(node)

    return ModulesRayTogether(config, log)


#: The local Ray the Ray tests share: room for 3 client workers and the training server, and 2 GPUs
#: it is told of (this machine may have none: device=auto then computes on the CPU).
LOCAL_RAY = {"num_cpus": 4, "num_gpus": 2}


@pytest.fixture(autouse=True)
def _working_directory_of_its_own(tmp_path_factory, monkeypatch):
    """Every test runs in an empty folder of its own, so nothing it writes by a relative path lands in
    the checkout: `certs out={a: 1}` once left a CA and private keys in the repository's root. A test
    that needs another folder changes to it itself (monkeypatch.chdir), which wins over this one."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


@pytest.fixture(autouse=True)
def _plugins_forgotten_after_the_test(tmp_path_factory):
    """Modules a test imported from its temporary folders (plugins: algorithms, models, datasets of
    its own) are dropped when it ends, and collected, so their classes leave the registries: a
    plugin's subclass of SFL-V2 would otherwise show in a later test's "applies to algorithm ...".
    The models and datasets a plugin registered are gone too, whichever test ran it (the Ray
    plugin test's dataset once showed in a later test's list of datasets on the same worker)."""
    from splitlab.data import datasets
    from splitlab.models import MODEL_INPUTS, MODEL_PARAMS, MODELS

    tables = [MODELS, MODEL_PARAMS, MODEL_INPUTS]
    tables += [datasets.DATASETS, datasets.LOCATORS, datasets.SPLIT_LOADERS, datasets.SAMPLES]
    saved = [dict(table) for table in tables]
    before = set(sys.modules)
    yield
    if any(table != kept for table, kept in zip(tables, saved)):
        for table, kept in zip(tables, saved):
            table.clear()
            table.update(kept)
        datasets._load_cached.cache_clear()
    base = tmp_path_factory.getbasetemp()
    added = [name for name in set(sys.modules) - before if _under(sys.modules[name], base)]
    for name in added:
        del sys.modules[name]
    if added:
        gc.collect()


def _under(module, folder: Path) -> bool:
    file = getattr(module, "__file__", None)
    return file is not None and Path(file).is_relative_to(folder)


@pytest.fixture(scope="session")
def _local_ray_stopped_at_the_end():
    yield
    import ray

    ray.shutdown()


@pytest.fixture
def local_ray(_local_ray_stopped_at_the_end):
    """One local Ray for all the Ray tests of this worker (`LOCAL_RAY`), started by the first that asks
    and kept (a start costs 4-17 s of the loaded machine's time). A test that needs another Ray (a
    multi-node cluster) or none (the pre-flight checks) shuts it down; the next one that asks starts
    it again. address="local": a Ray of its own, even where another one runs on this machine
    (ray.init would join that one, and refuse num_cpus there)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", **LOCAL_RAY, include_dashboard=False, log_to_driver=False)
    yield ray
