"""splitlab.process: a training process keeps freed memory for reuse instead of faulting it in again."""

import subprocess
import sys

import pytest

CHILD = """
import resource, sys, torch
from splitlab.process import reuse_freed_memory

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
