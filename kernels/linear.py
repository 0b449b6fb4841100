"""The matmul of the linear layers: torch's F.linear, or on CPU in bfloat16 from a copy of the
weight packed once for the tiles that multiply it (the AMX kernel's layout or oneDNN's:
kernels/packed_weights.py), or for a few rows (decode) the C++ small-M kernel
(kernels/cpu/small_m_linear.cpp), which reads each weight row once for all rows.
small_m_linear_reference is what the C++ kernels are tested against."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_kernels
from kernels.packed_weights import packed_linear
from kernels.timing import best_seconds

# Most rows of x the C++ kernel may take; more go to torch. The engine measures, at start, up to
# how many rows it beats torch's bf16 mm on this host (calibrate_small_m_max_rows): at 1 row it
# reads the weights 2-3.5x faster, but past a handful of rows the step is compute-bound, and
# torch's mm (oneDNN, on AMX where the CPU has it) can win by far: on one host the kernel took
# 1.15-1.67x less time than torch at 64 rows (November 29), on another it took 3x more from 32
# rows up and broke even at about 12 (`python bench/cpu_linear.py --rows 1,8,12,16,32,64`).
SMALL_M_MAX_ROWS = 64
# Rows tried, in order, by the calibration: the kernel keeps each while it wins by a margin.
SMALL_M_CANDIDATES = (1, 4, 8, 16, 32, 64)
# The kernel must take at most this share of torch's time to keep a row count: near the
# crossover the two are within noise, and either choice costs little there.
SMALL_M_MARGIN = 0.9
# Rows from which the packed copies are left aside for torch's F.linear on the plain weights:
# at prefill's hundreds of rows the matmul is compute-bound, and there oneDNN's own plan for
# the plain weight (its reorder paid once per call, spread over the rows) beat both packed
# layouts by 3-7% at 384, 512 and 1,024 rows, where at 256 rows and fewer the packed copies
# won by 1.2-2.8x (`python bench/cpu_linear.py --rows 256,384,512,1024 --layouts packed,amx
# --skip-engine`, December 2).
PACKED_MAX_ROWS = 383
# Row counts torch's bfloat16 matmul sees on the CPU are rounded up to a multiple of this. oneDNN
# and torch's ideep layer keep a primitive, with its scratch, per row count met (LRU, 1,024
# entries): about 3 MB for each new prompt length on SmolLM2 in bfloat16 (50 new lengths of the
# same range: +147 MiB; float32 goes through MKL and adds nothing), so a prefill worker grew
# towards gigabytes as it met every step size. Rounded, a step of up to 2,048 tokens meets at
# most 128 row counts, and after them every one is a cache hit (a new one costs ~0.4 ms per
# linear to build); the padded rows cost at most 15 rows of compute.
# SPLITSERVE_CPU_LINEAR_ROW_BUCKET=1: no rounding (bench/linear_shapes.py's baseline).
ROW_BUCKET = max(1, int(os.environ.get("SPLITSERVE_CPU_LINEAR_ROW_BUCKET", "16")))
# Weights the calibration cycles through (the model's own, in order): more than the L2, so
# the weights stream as they do in a step.
CALIBRATION_WEIGHT_BYTES = 32 << 20


def small_m_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias) in float32, rounded once to x's dtype."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def small_m_linear_available() -> bool:
    """Whether the C++ kernel runs its AVX-512 BF16 path here. Elsewhere its portable path is
    correct but slower than torch, so the engine does not use it."""
    return cpu_kernels.load() and torch.ops.splitserve_cpu.cpu_has_avx512_bf16()


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, small_m_max_rows: int,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear, by the C++ kernel when x is [M, K] with 0 < M <= small_m_max_rows (0: never),
    else from `packed` (the weight as kernels.packed_weights.pack_weight returned it, in
    either layout) when given and x is [M, K] with M <= PACKED_MAX_ROWS. The caller enables
    both only for CPU bfloat16 weights."""
    if x.dim() == 2:
        rows = x.shape[0]
        if 0 < rows <= small_m_max_rows:
            return torch.ops.splitserve_cpu.small_m_linear(x, weight, bias)
        if rows % ROW_BUCKET and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            x = bucketed_rows(x)
        if packed is not None and rows <= PACKED_MAX_ROWS:
            return packed_linear(x, packed, bias, weight.shape[0])[:rows]
        return F.linear(x, weight, bias)[:rows]
    return F.linear(x, weight, bias)


def bucketed_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with zero rows added up to a multiple of ROW_BUCKET."""
    rows = x.shape[0]
    padded = x.new_empty((-(-rows // ROW_BUCKET) * ROW_BUCKET, x.shape[1]))
    padded[:rows] = x
    padded[rows:].zero_()
    return padded


@dataclass(frozen=True)
class SmallMCalibration:
    """Up to how many rows the C++ kernel beats torch's mm here, and what was timed: (rows,
    kernel seconds, torch seconds) per row count tried, each over the same weights."""

    max_rows: int
    timings: tuple[tuple[int, float, float], ...]

    def describe(self) -> str:
        times = ", ".join(f"{m}: {cpp * 1e3:.2f} vs {ref * 1e3:.2f} ms" for m, cpp, ref in self.timings)
        return f"small-M linear up to {self.max_rows} rows (kernel vs torch per pass: {times})"


def calibrate_small_m_max_rows(weights: list[torch.Tensor], repeats: int = 3,
                               candidates: tuple[int, ...] = SMALL_M_CANDIDATES,
                               margin: float = SMALL_M_MARGIN,
                               packed: list[torch.Tensor] | None = None) -> SmallMCalibration:
    """Times the C++ kernel and torch's path on `weights` (bf16 [N, K], e.g. a model's first
    layers: F.linear, or from `packed`, the same weights packed, when the layers will use
    them) for each row count in `candidates`, in order, alternating the two and keeping the
    best of `repeats` passes over all the weights; stops at the second count in a row where
    the kernel takes more than `margin` of torch's time. max_rows: the last count it won (0:
    none). One loss does not stop it: a worker starting beside another (disaggregated on 2
    cores, both calibrating at once) once measured 1 row at 0.93 of torch's time and stopped
    there, and its decode steps then ran every row count on torch's path, the kernel's 4-32
    rows at 0.55-0.72 of torch's time included."""
    max_rows, timings, losses = 0, [], 0
    generator = torch.Generator().manual_seed(0)
    for rows in candidates:
        xs = [torch.randn(rows, w.shape[1], generator=generator).to(w.dtype) for w in weights]
        pairs = list(zip(xs, weights, strict=True))
        best = best_seconds({
            "cpp": lambda pairs=pairs: [torch.ops.splitserve_cpu.small_m_linear(x, w, None)
                                        for x, w in pairs],
            "torch": lambda pairs=pairs: [linear(x, w, None, 0, p)
                                          for (x, w), p in zip(pairs, packed or [None] * len(pairs), strict=True)],
        }, repeats)
        timings.append((rows, best["cpp"], best["torch"]))
        if best["cpp"] > margin * best["torch"]:
            losses += 1
            if losses == 2:
                break
            continue
        max_rows, losses = rows, 0
    return SmallMCalibration(max_rows, tuple(timings))


def calibration_layers(model: torch.nn.Module, budget: int = CALIBRATION_WEIGHT_BYTES) -> list[torch.nn.Module]:
    """The model's linear layers in module order (its first layers' projections, not the LM
    head) up to `budget` bytes of weights: the shapes a decode step multiplies."""
    chosen, total = [], 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not hasattr(module, "small_m_max_rows") or weight is None or weight.dim() != 2
                or module is getattr(model, "lm_head", None)):
            continue
        chosen.append(module)
        total += weight.numel() * weight.element_size()
        if total >= budget:
            break
    return chosen


def calibration_weights(model: torch.nn.Module, budget: int = CALIBRATION_WEIGHT_BYTES) -> list[torch.Tensor]:
    """The weights of calibration_layers."""
    return [layer.weight.detach() for layer in calibration_layers(model, budget)]
