"""splitlab.process_settings: a training process keeps freed memory for reuse instead of faulting it in again."""

import os
import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from splitlab.process_settings import reuse_freed_memory

def faults_of_ten_allocations():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        block = torch.empty(64 << 18)  # 64 MiB, above glibc's largest default mmap threshold
        block.fill_(1.0)  # touch every page
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_ten_allocations()
assert reuse_freed_memory()
faults_of_ten_allocations()  # the heap grows to hold the block once
print(default, faults_of_ten_allocations())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_freed_blocks_are_reused_without_page_faults() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    default, kept = map(int, out.split())
    assert default >= 10  # by default every allocation faults its pages in again (4 KiB or huge pages)
    assert kept * 20 <= default  # kept for reuse: next to nothing to fault in


PEAK_CHILD = """
import torch
from splitlab.process_settings import peak_memory_mib

before = peak_memory_mib()
block = torch.ones(200 << 18)  # 200 MiB, every page touched
print(before, peak_memory_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's /proc")
def test_a_child_reports_its_own_peak_memory_not_its_parents() -> None:
    parent_block = bytearray(1 << 30)  # the parent holds 1 GiB, every page touched
    parent_block[:: 1 << 12] = b"\1" * (len(parent_block) >> 12)
    out = subprocess.run([sys.executable, "-c", PEAK_CHILD], capture_output=True, text=True, check=True).stdout
    before, after = map(float, out.split())
    assert before < 1000  # ru_maxrss would start at the parent's 1 GiB
    assert after - before >= 190


PYTHON_API_CHILD = """
import resource, sys, torch
from splitlab.engine import run

def faults_of_ten_allocations():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        block = torch.empty(64 << 18)
        block.fill_(1.0)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

default = faults_of_ten_allocations()
run({"dataset": "synthetic", "model": "mlp", "clients": 2, "rounds": 1, "device": "cpu", "out": sys.argv[1]},
    progress=False)
faults_of_ten_allocations()
print(default, faults_of_ten_allocations())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_run_from_python_sets_up_the_process_as_the_cli_does(tmp_path) -> None:
    """engine.run goes through process.prepare_process: freed memory is kept for reuse from Python too."""
    out = subprocess.run(
        [sys.executable, "-c", PYTHON_API_CHILD, str(tmp_path / "r")], capture_output=True, text=True, check=True
    ).stdout
    default, kept = map(int, out.split())
    assert default >= 10 and kept * 20 <= default


def test_a_cuda_device_turns_on_deterministic_kernels() -> None:
    """Without it, two identical runs on a GPU differ after the first step (seen on an H200)."""
    child = (
        "import os, torch\n"
        "from splitlab.process_settings import prepare_process, training_device\n"
        "prepare_process()\n"
        "assert os.environ['CUBLAS_WORKSPACE_CONFIG'] == ':4096:8'\n"
        "training_device(torch.device('cpu'))\n"
        "assert not torch.are_deterministic_algorithms_enabled()\n"
        "training_device(torch.device('cuda'))\n"
        "assert torch.are_deterministic_algorithms_enabled()\n"
        "assert torch.is_deterministic_algorithms_warn_only_enabled()\n"
        "assert not torch.backends.cudnn.benchmark\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    subprocess.run([sys.executable, "-c", child], check=True, env=env)
