"""Linear weights kept on CPU (bfloat16) in the layout the matmul's tiles read, so no call
reorders a weight: "amx", the layout of our AMX kernel (kernels/cpu/amx_linear.cpp), where the
CPU has AMX BF16; else "packed", oneDNN's own blocked layout for torch's matmul.

torch's bf16 F.linear hands oneDNN a plain [N, K] weight, which oneDNN first copies into the
blocked (VNNI) layout its AMX / AVX-512 micro-kernels read: each weight crosses memory three
times a step instead of once. A decode step reads every weight from DRAM, so that copy costs
a third of its matmul time: on one host a SmolLM2 decoder layer's four projections took 761 us
at 64 rows and 559 at 16 with plain weights, 488 and 372 packed, 1.5x less at every row count
from 1 to 64 (`python bench/cpu_linear.py --rows 1,4,8,16,64 --packed --skip-engine`). Packed
for oneDNN, its matmul still took 1.5-1.7x the AMX kernel's time for a decoder layer's
projections at 1-32 rows (`python bench/cpu_linear.py --rows 1,8,16,32 --layouts packed,amx
--skip-engine`). The copy is made once at
start and costs memory: a second copy of each packed weight, the plain one staying for the
small-M kernel, the embedding (tied weights) and weight loading.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.timing import best_seconds

# The row count oneDNN is told to expect when packing: decode batches. On the host above, a
# weight packed for 64 rows served 1 to 512 rows as fast as one packed for that count (and a
# weight packed for 512 rows was slower at 512 than plain).
PACK_ROWS_HINT = 64
# The AMX kernel multiplies K in steps of 32 (one tile row of bfloat16).
AMX_K_MULTIPLE = 32
# The weight layouts a linear layer's packed copy may have (cpu_weight_layout, past "auto").
LAYOUTS = ("amx", "packed", "plain")
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


def amx_available() -> bool:
    """Whether the AMX linear kernel runs here: the C++ kernels built, a CPU with AMX BF16."""
    return cpu_kernels.load() and bool(torch.ops.splitserve_cpu.has_amx_linear())


def amx_packable(weight: torch.Tensor) -> bool:
    """Whether the AMX kernel takes this weight: [N, K] bfloat16 on the CPU, K a multiple of 32."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[1] % AMX_K_MULTIPLE == 0)


def pack_weight(weight: torch.Tensor, layout: str = "packed") -> torch.Tensor:
    """weight [N, K] (bf16, CPU) in `layout`, for packed_linear: "amx" (the AMX kernel's tiles)
    or "packed" (oneDNN's blocked layout)."""
    if layout == "amx":
        if not amx_available():
            raise RuntimeError("the amx layout needs a CPU with AMX BF16 and the C++ kernels built")
        return torch.ops.splitserve_cpu.amx_pack_linear_weight(weight.detach())
    if layout == "packed":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    raise ValueError(f"no packed layout {layout!r} (amx or packed)")


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [M, K], with the weight [out_features, K] as
    pack_weight returned it (oneDNN's copies are mkldnn tensors, the AMX kernel's dense)."""
    if packed.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.splitserve_cpu.amx_linear(x, packed, bias, out_features)


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
            "packed": lambda xs=xs: [packed_linear(x, p, None, w.shape[0])
                                     for x, p, w in zip(xs, packed, weights, strict=True)],
            "plain": lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
        }, repeats)
        timings.append((rows, best["packed"], best["plain"]))
    wins = all(p <= margin * q for _, p, q in timings)
    return PackingCalibration(wins, tuple(timings))
