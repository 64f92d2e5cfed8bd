"""Process-wide settings of a process that trains (malloc that keeps freed memory, torch threads,
splitlab's log handler), and its peak memory.

`prepare_process` is the one way in: the CLI, `splitlab.engine.run` called from Python, sweep
workers and Ray actors all go through it, so a run is as fast from Python as from the command line.

Training allocates tensors of the same large sizes at every step (gradients, activations, Adam's
moments, a checkpoint's bytes). glibc's malloc hands a freed block above its mmap threshold (at
most 32 MiB, moved up and down as blocks come and go) back to the operating system, and the next
allocation of that size page-faults every page in again: an FSL-SAGE run on Fashion-MNIST spent
30 s of 200 s in the kernel that way, 9.6 million page faults (docs/performance.md). Raising the
mmap and trim thresholds keeps freed blocks in the heap for reuse. The price: memory, once used,
stays with the process until it ends (its peak is the same).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from splitlab.logs import setup_logging

if TYPE_CHECKING:
    import torch

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
KEEP_BLOCKS_UP_TO = 1 << 31  # 2 GiB; larger blocks still come from, and go back to, the OS


def reuse_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks up to KEEP_BLOCKS_UP_TO bytes for reuse; False where
    the C library is not glibc (its allocator is left as it is)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # another C library: its mallopt, if any, differs
        return False
    mallopt = libc.mallopt
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BLOCKS_UP_TO)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BLOCKS_UP_TO))


def peak_memory_mib() -> float:
    """This process's peak resident set size, in MiB: Linux's VmHWM, which starts afresh at exec.
    (`ru_maxrss` does not: a child started by a 2 GB process reports at least 2 GB.)"""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / (2**20 if sys.platform == "darwin" else 1024)  # bytes on macOS, kB elsewhere


def prepare_process() -> None:
    """Set up this process for training, once: freed memory kept for reuse, cuBLAS's deterministic
    workspace (read when CUDA first uses cuBLAS, so before any run), splitlab's log handler (unless
    one is set up already)."""
    global _PREPARED
    if not _PREPARED:
        reuse_freed_memory()
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        _PREPARED = True
    setup_logging()


def training_device(device: torch.device, deterministic: bool = True) -> torch.device:
    """`device`, made to give a run that is a function of its seed on a GPU too, as on the CPU:
    deterministic CUDA kernels where torch has them (cuDNN's convolutions, index and scatter sums),
    cuDNN's autotuner off. Without this, two identical runs on a GPU differ after the first step
    (seen on an H200 for every algorithm). An op with no deterministic CUDA kernel warns rather
    than stops the run. `deterministic=False` (the run's key, set when its roles are built):
    torch's fastest kernels and cuDNN's autotuner instead."""
    if device.type == "cuda":
        import torch

        torch.use_deterministic_algorithms(deterministic, warn_only=True)
        torch.backends.cudnn.benchmark = not deterministic
    return device


_PREPARED = False


def set_worker_threads(threads: int) -> None:
    """Set up a worker process (a sweep's, a Ray actor or task): `prepare_process`, and `threads`
    torch threads, so that workers side by side never ask for more cores than they got."""
    import torch

    prepare_process()
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set, or parallel work already started
        torch.set_num_interop_threads(1)
