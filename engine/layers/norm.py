"""RMSNorm with an optional fused residual add, computed in float32 like the reference; on CUDA
with the Triton backend, one fused kernel (kernels/triton/rmsnorm.py) held to this torch path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.attention import uses_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        # The C++ kernel (torch.ops.splitserve_cpu.rms_norm_step, within a bf16 ulp of the torch
        # code below) for bfloat16 rows on the CPU; set by the model with the fused decode path.
        self.native = False

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, backend: str = "auto"
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """backend: the step's attention backend (AttentionMetadata.attention_backend); the
        Triton kernel runs on CUDA only, so every CPU path stays this torch code."""
        if x.is_cuda and x.dtype == self.weight.dtype and uses_triton(backend, x.device):
            from kernels.triton.rmsnorm import triton_rmsnorm  # needs triton

            return triton_rmsnorm(x, self.weight, self.eps, residual)
        if self.native and x.dtype == torch.bfloat16 and x.dim() == 2 and not x.is_cuda:
            out, summed = torch.ops.splitserve_cpu.rms_norm_step(x, residual, self.weight, self.eps)
            return out if residual is None else (out, summed)
        if residual is not None:
            x = x + residual
            residual = x
        # F.rms_norm is one fused kernel and bit-identical to x * rsqrt(mean(x^2) + eps) * w.
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        else:  # the reference rounds to the model's dtype before scaling by the weight
            out = self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return out if residual is None else (out, residual)
