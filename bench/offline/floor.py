"""The memory floor of a decode step: the weight bytes it must read over the bandwidth of only
reading a large tensor. (A copy also writes what it reads; bytes copied over time is not a
floor.) Imported by the vLLM child too: torch and stdlib only."""

from __future__ import annotations

import statistics
import time

import torch

SAMPLE_BYTES = 512 << 20


def bandwidth_gbs(nbytes: int, seconds: float) -> float:
    """GB/s of moving nbytes in seconds (10^9 bytes a GB)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return nbytes / seconds / 1e9


def floor_ms(weight_bytes: int, gbs: float) -> float:
    """Milliseconds to read weight_bytes once at gbs GB/s: no decode step can be faster."""
    if gbs <= 0:
        raise ValueError(f"bandwidth must be > 0, got {gbs}")
    return weight_bytes / (gbs * 1e9) * 1e3


def read_bandwidth_gbs(nbytes: int = SAMPLE_BYTES, reps: int = 7) -> float:
    """Bytes read / time of a float32 sum over a large tensor, median of reps."""
    src = torch.ones(nbytes // 4)
    src.sum()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        src.sum()
        times.append(time.perf_counter() - start)
    return bandwidth_gbs(src.numel() * 4, statistics.median(times))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters a decode step reads; tied embeddings count once."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())
