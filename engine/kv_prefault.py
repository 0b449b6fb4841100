"""Faulting the CPU KV pool's pages in ahead of the blocks the engine will write next, while
the engine is idle, so that no step pays for them.

The CPU pool is an anonymous memory mapping (kv_tensor.zeroed): start-up takes no time
for it and its unused blocks take no memory, but the first write to each 4 KiB page is a
page fault, and the kernel zeroes the page inside the step that writes it. A burst of 32
prompts of 128 tokens writes about 23,000 new pages of SmolLM2's cache (23 KiB per token
over 30 layers); those faults cost ~2-14 us each in this VM, and the burst's prefill took
about a quarter longer with fresh pages than with pages faulted in beforehand (1,697 against
1,351 ms, `python bench/kv_prefault.py`).

The block pool hands out never-used blocks in id order before it reuses any
(engine/block_pool.py), so the blocks the engine writes next are those just past the
highest id it has handed out. While the engine has nothing to run, the engine loop calls
`KVPrefault.advance` for a slice at a time: it asks the kernel to fault in every page of the
next blocks, up to `margin_blocks` past that mark, with madvise(MADV_POPULATE_WRITE), which
allocates and zeroes the pages without changing a byte of what they hold. Only what is about
to be used becomes resident, not the whole pool.

Linux 5.14 and later; elsewhere (or if the kernel refuses) it turns itself off and says so
once. CPU only: a GPU pool is allocated up front.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import os

import torch

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h, since 5.14
# A slice: about this many bytes of the pool per call, 2-15 ms here, so
# a request that arrives while the loop prefaults waits at most that long.
SLICE_BYTES = 2 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

_libc: ctypes.CDLL | None = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)  # foreign calls release the GIL
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


class KVPrefault:
    """Faults in the pages of a KV pool [layers, 2, blocks, ...] block by block, in block
    order. Not thread-safe: the engine thread calls it."""

    def __init__(self, pool: torch.Tensor, margin_blocks: int) -> None:
        if pool.device.type != "cpu" or not pool.is_contiguous():
            raise ValueError("KVPrefault needs a contiguous CPU pool")
        if margin_blocks < 1:
            raise ValueError("margin_blocks must be >= 1")
        self.num_blocks = pool.shape[2]
        self.num_planes = pool.shape[0] * pool.shape[1]  # one (layer, K or V) plane each
        self.block_bytes = math.prod(pool.shape[3:]) * pool.element_size()  # per plane
        self.margin_blocks = margin_blocks
        self.slice_blocks = max(1, SLICE_BYTES // (self.block_bytes * self.num_planes))
        self._base = pool.data_ptr()
        self._plane_bytes = self.num_blocks * self.block_bytes
        self._pool = pool  # keeps the mapping alive while this holds its address
        self.faulted = 0  # blocks [0, faulted) are resident in every plane
        self.enabled = True

    def target(self, high_water: int) -> int:
        """The blocks to have resident once the pool has handed out [0, high_water)."""
        return min(self.num_blocks, high_water + self.margin_blocks)

    def advance(self, high_water: int) -> bool:
        """Faults in the next slice of blocks short of target(high_water); False when there
        was nothing to do (caught up, or off)."""
        end = min(self.target(high_water), self.faulted + self.slice_blocks)
        if not self.enabled or end <= self.faulted:
            return False
        madvise = _madvise()
        for plane in range(self.num_planes):
            start = self._base + plane * self._plane_bytes + self.faulted * self.block_bytes
            stop = self._base + plane * self._plane_bytes + end * self.block_bytes
            first = start - start % _PAGE  # madvise takes whole pages; faulting a
            last = -(-stop // _PAGE) * _PAGE  # neighbour's page in changes nothing in it
            if madvise(first, last - first, MADV_POPULATE_WRITE) != 0:
                code = ctypes.get_errno()
                self.enabled = False
                log.info("KV pool prefault off: madvise(MADV_POPULATE_WRITE) failed with %s "
                         "(Linux 5.14 or later has it); pages are faulted in as steps write "
                         "them", errno.errorcode.get(code, code))
                return False
        self.faulted = end
        return True
