"""Fused residual add + RMSNorm in Triton: one program per row adds the residual, normalizes in
float32 and scales by the weight, writing both the output and the new residual.

Reference and oracle: engine/layers/norm.py RMSNorm (its torch path). Rounding follows it
step by step: the sum is rounded to the input dtype (it is the new residual), the normalized
row is rounded to the input dtype before the weight multiplies it (bfloat16), or scaled in
float32 in one go (float32). Runs on CUDA, and on CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.rounding import round_bf16


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    eps, hidden,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, ROUND_BEFORE_WEIGHT: tl.constexpr, BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = round_bf16(x + r, BF16).to(dtype).to(tl.float32)  # the reference's x + residual
        tl.store(res_out_ptr + row * stride_ro + cols, x.to(dtype), mask=ok)
    mean_sq = tl.sum(x * x, axis=0) / hidden
    normed = x * tl.math.rsqrt(mean_sq + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if ROUND_BEFORE_WEIGHT:
        normed = round_bf16(normed, BF16).to(dtype).to(tl.float32)
    out = round_bf16(normed * w, BF16).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)



def num_warps(block: int) -> int:
    """Warps for a row of `block` (a power of two) elements: one per 512, 1 to 16."""
    return min(max(block // 512, 1), 16)

def triton_rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [rows, hidden] (any leading shape), weight: [hidden] -> rmsnorm(x +
    residual) * weight, and the new residual x + residual when one is given (as RMSNorm)."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight of shape {tuple(weight.shape)} for rows of {hidden}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match "
                         f"x {tuple(x.shape)} {x.dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"rmsnorm kernel takes float32, bfloat16 or float16, not {x.dtype}")
    rows_x = x.reshape(-1, hidden)
    if rows_x.stride(-1) != 1:
        rows_x = rows_x.contiguous()
    out = torch.empty(rows_x.shape, dtype=x.dtype, device=x.device)
    res_in = res_out = rows_x  # unused without a residual (HAS_RESIDUAL is a constant)
    if residual is not None:
        res_in = residual.reshape(-1, hidden)
        if res_in.stride(-1) != 1:
            res_in = res_in.contiguous()
        res_out = torch.empty_like(out)
    block = triton.next_power_of_2(hidden)
    if rows_x.shape[0]:
        _rmsnorm_kernel[(rows_x.shape[0],)](
            rows_x, res_in, weight, out, res_out, float(eps), hidden,
            rows_x.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None,
            ROUND_BEFORE_WEIGHT=x.dtype != torch.float32, BF16=x.dtype == torch.bfloat16,
            BLOCK=block, num_warps=num_warps(block),
        )
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))
