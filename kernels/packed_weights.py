"""Linear weights kept in oneDNN's own blocked layout on CPU (bfloat16), so torch's mm does not
reorder every weight on every call.

torch's bf16 F.linear hands oneDNN a plain [N, K] weight, which oneDNN first copies into the
blocked (VNNI) layout its AMX / AVX-512 micro-kernels read: each weight crosses memory three
times a step instead of once. A decode step reads every weight from DRAM, so that copy costs
a third of its matmul time: on one host a SmolLM2 decoder layer's four projections took 761 us
at 64 rows and 559 at 16 with plain weights, 488 and 372 packed, 1.5x less at every row count
from 1 to 64 (`python bench/cpu_linear.py --rows 1,4,8,16,64 --packed --skip-engine`). The
packed copy is made once at start (the engine measures first whether it wins here:
calibrate_packing) and costs memory: a second copy of each packed weight, the plain one
staying for the small-M kernel, the embedding (tied weights) and weight loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.timing import best_seconds

# The row count oneDNN is told to expect when packing: decode batches. On the host above, a
# weight packed for 64 rows served 1 to 512 rows as fast as one packed for that count (and a
# weight packed for 512 rows was slower at 512 than plain).
PACK_ROWS_HINT = 64
# Rows the calibration times: the decode batches where packing matters.
CALIBRATION_ROWS = (16, 64)
# Packed weights are kept only if they take at most this share of plain F.linear's time.
PACKING_MARGIN = 0.9
# ... and, unless asked for, only if their copies take at most this share of the host's
# available memory: the KV pool, the other processes of the host and the page cache need the
# rest, and a model near the size of the RAM must still start.
PACKED_MEMORY_SHARE = 0.25


def packing_available() -> bool:
    """Whether this torch build can pack weights for oneDNN (CPU builds with mkldnn)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (bf16, CPU) in oneDNN's blocked layout, for packed_linear."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], with the weight as pack_weight returned it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@dataclass(frozen=True)
class PackingCalibration:
    """Whether packed weights beat plain F.linear here, and the seconds each took per pass over
    the calibration weights, per row count timed: (rows, packed s, plain s)."""

    packed: bool
    timings: tuple[tuple[int, float, float], ...]

    def describe(self) -> str:
        times = ", ".join(f"{m} rows: {p * 1e3:.2f} vs {q * 1e3:.2f} ms" for m, p, q in self.timings)
        return f"linear weights {'packed' if self.packed else 'plain'} (packed vs plain per pass: {times})"


def calibrate_packing(weights: list[torch.Tensor], repeats: int = 3,
                      margin: float = PACKING_MARGIN) -> PackingCalibration:
    """Times F.linear on `weights` (bf16 [N, K], more than the L2 so they stream from memory as
    in a step) plain and packed at each of CALIBRATION_ROWS, alternating, the best of `repeats`
    passes; packed wins if at every row count it takes at most `margin` of plain's time."""
    generator = torch.Generator().manual_seed(0)
    packed = [pack_weight(w) for w in weights]
    timings = []
    for rows in CALIBRATION_ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=generator).to(w.dtype) for w in weights]
        best = best_seconds({
            "packed": lambda xs=xs: [packed_linear(x, p, None) for x, p in zip(xs, packed, strict=True)],
            "plain": lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
        }, repeats)
        timings.append((rows, best["packed"], best["plain"]))
    wins = all(p <= margin * q for _, p, q in timings)
    return PackingCalibration(wins, tuple(timings))
