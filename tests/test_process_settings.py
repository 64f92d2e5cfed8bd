"""splitlab.process_settings: a training process keeps freed memory for reuse instead of faulting it
in again, reports its own peak memory, and turns on deterministic kernels on a GPU. One child
process (a fresh interpreter, as a user's) checks all of it: its start-up is most of the cost."""

import json
import os
import subprocess
import sys

import pytest

CHILD = """
import json, os, resource, sys, torch
from splitlab.engine import run
from splitlab.process_settings import peak_memory_mib, reuse_freed_memory, training_device

def faults_of_ten_allocations():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        block = torch.empty(64 << 18)  # 64 MiB, above glibc's largest default mmap threshold
        block.fill_(1.0)  # touch every page
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

found = {"peak_before": peak_memory_mib()}
block = torch.ones(200 << 18)  # 200 MiB, every page touched
found["peak_after"] = peak_memory_mib()
del block
found["default_faults"] = faults_of_ten_allocations()
# engine.run goes through prepare_process, as the CLI does
run({"dataset": "synthetic", "model": "mlp", "clients": 2, "rounds": 1, "device": "cpu", "out": sys.argv[1]},
    progress=False)
faults_of_ten_allocations()  # the heap grows to hold the block once
found["kept_faults"] = faults_of_ten_allocations()
found["reuse_freed_memory"] = reuse_freed_memory()
found["cublas_workspace"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
training_device(torch.device("cpu"))
found["deterministic_on_cpu"] = torch.are_deterministic_algorithms_enabled()
training_device(torch.device("cuda"))
found["deterministic_on_cuda"] = torch.are_deterministic_algorithms_enabled()
found["warn_only"] = torch.is_deterministic_algorithms_warn_only_enabled()
found["cudnn_benchmark"] = torch.backends.cudnn.benchmark
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def child(tmp_path_factory) -> dict:
    """What the child found, while this process holds 1 GiB with every page touched."""
    parent_block = bytearray(1 << 30)
    parent_block[:: 1 << 12] = b"\1" * (len(parent_block) >> 12)
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = tmp_path_factory.mktemp("run") / "r"
    done = subprocess.run([sys.executable, "-c", CHILD, str(out)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    del parent_block
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_run_keeps_freed_blocks_for_reuse_without_page_faults(child) -> None:
    """engine.run goes through process.prepare_process: freed memory is kept for reuse from Python too."""
    assert child["default_faults"] >= 10  # by default every allocation faults its pages in again
    assert child["kept_faults"] * 20 <= child["default_faults"]  # kept for reuse: next to nothing to fault in
    assert child["reuse_freed_memory"] is True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")
def test_a_child_reports_its_own_peak_memory_not_its_parents(child) -> None:
    assert child["peak_before"] < 1000  # ru_maxrss would start at the parent's 1 GiB
    assert child["peak_after"] - child["peak_before"] >= 190


def test_a_cuda_device_turns_on_deterministic_kernels(child) -> None:
    """Without it, two identical runs on a GPU differ after the first step (seen on an H200)."""
    assert child["cublas_workspace"] == ":4096:8"
    assert not child["deterministic_on_cpu"]
    assert child["deterministic_on_cuda"] and child["warn_only"] and not child["cudnn_benchmark"]
