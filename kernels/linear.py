"""The matmul of the linear layers: torch's F.linear, or on CPU in bfloat16 for a few rows
(decode) the C++ small-M kernel (kernels/cpu/small_m_linear.cpp), which reads each weight row
once for all rows. small_m_linear_reference is what that kernel is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_kernels

# Most rows of x the C++ kernel takes; more go to torch. Measured with bench/cpu_linear.py
# --rows 1,8,16,24,32,64 on SmolLM2's shapes (2 threads, AVX-512 BF16, built with OpenMP): the
# kernel took 1.6-2.1x less time than torch's bf16 mm at 1 row, 1.6-2.5x at 8 to 24 rows, and
# still 1.15-1.67x at 64 rows (gate_up_proj 278 vs 334 us, lm_head 4.55 vs 5.25 ms), so every
# decode batch of up to 64 rows (and prefill chunks that short) takes it.
SMALL_M_MAX_ROWS = 64


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
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, small_m_max_rows: int
) -> torch.Tensor:
    """F.linear, by the C++ kernel when x is [M, K] with 0 < M <= small_m_max_rows (0: never).
    The caller enables it only for CPU bfloat16 weights (see small_m_linear_available)."""
    if x.dim() == 2 and 0 < x.shape[0] <= small_m_max_rows:
        return torch.ops.splitserve_cpu.small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)
