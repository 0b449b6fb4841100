"""Keeps glibc from handing freed activation memory back to the kernel between layers.

A forward pass on CPU allocates and frees tensors of several MB per layer (activations, the
decode KV gathers). With glibc's default (dynamic) thresholds those go back to the kernel on
free and come back as fresh pages on the next allocation, and the page faults cost as much as
the step itself: SmolLM2-135M decoding 64 sequences took 183k faults and 0.68 s of CPU per
step, 0.31 s with the thresholds below. Process-wide; called once by a CPU model runner.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(trim_threshold: int = 1 << 30, mmap_threshold: int = 32 << 20) -> bool:
    """Retain up to `trim_threshold` bytes of freed heap, and serve blocks up to
    `mmap_threshold` (glibc's maximum) from the heap rather than from fresh mappings.
    Returns False where the C library is not glibc (nothing is changed)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold)) and bool(
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold)
    )
