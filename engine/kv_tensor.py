"""The paged KV cache as memory: its allocation, its size per block, and a request's blocks
taken out as one payload (prefill worker) or written in from one (decode worker).

Layout, the same on both sides of a transfer: [layers, 2 (K, V), blocks, block_size, kv_heads,
head_dim], so a request's KV is one index_select along the blocks axis.
"""

from __future__ import annotations

import math
import mmap

import torch

from engine.config import ModelConfig
from kv_transfer.buffer_pool import KVBufferPool


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On CPU it lies in an anonymous memory mapping: the kernel's zero pages,
    each taken when first written, so a 1 GiB KV pool costs nothing at start (torch.zeros
    writes every page: 0.4-2.5 s here, with the VM's memory in its slower states) and its
    unused blocks take no RAM. Elsewhere torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # The tensor's storage keeps the mapping alive (frombuffer holds a reference to it).
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


def kv_cache_bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype, kv_heads: int) -> int:
    return model.num_layers * 2 * block_size * kv_heads * model.head_dim * dtype.itemsize


class KVPayloads:
    """Moves whole requests' blocks between one KV cache tensor and contiguous payloads."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        # On CPU gather fills buffers handed back after their transfer (release): 4 ms for
        # 47 MB against 11 ms into new memory (bench/kv_gather.py). CUDA's allocator reuses.
        self.staging = KVBufferPool(kv_cache.device) if kv_cache.device.type == "cpu" else None

    def gather(self, block_ids: list[int]) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        if self.staging is None:
            return self.kv_cache.index_select(2, index)
        shape = (*self.kv_cache.shape[:2], len(block_ids), *self.kv_cache.shape[3:])
        out = self.staging.acquire(shape, self.kv_cache.dtype)
        return torch.index_select(self.kv_cache, 2, index, out=out)

    def release(self, kv: torch.Tensor) -> None:
        """A gathered payload back to the pool once nothing reads it (thread-safe)."""
        if self.staging is not None:
            self.staging.release(kv)

    def scatter(self, block_ids: list[int], payload: torch.Tensor) -> None:
        index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_cache.device)
        self.kv_cache.index_copy_(2, index, payload.to(self.kv_cache.device, self.kv_cache.dtype))
