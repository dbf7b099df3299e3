"""glibc's malloc kept from handing a prompt chunk's blocks back to the kernel after every call."""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_FROM = 32 << 20  # the largest threshold glibc takes: blocks up to this size come from the heap
TRIM_FROM = 1 << 30  # freed heap memory kept for the next chunk's tensors, up to this much
ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_blocks() -> bool:
    """Blocks of up to 32 MiB from the heap, and up to 1 GiB of freed heap kept for reuse. Otherwise glibc maps a
    block over its threshold (128 KiB at first) fresh from the kernel and unmaps it on free, so a prompt chunk's
    tensors of a few MiB each fault their pages in again on every call: 2.7% of a 512-token read of the real
    Qwen3-30B-A3B shapes on a 2-core CPU, in the kernel's page-fault handlers. A process whose environment sets
    glibc's own `MALLOC_*_THRESHOLD_` keeps its choice. Returns whether the thresholds were set (False off glibc)."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in ENVIRONMENT):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_FROM)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_FROM))
