"""Rotary position embedding (rotate-half layout) with an optional llama3 frequency scaling.

The cos/sin table is built once for every position, in float32, from the same products the
reference computes, so positions map to bit-identical angles.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type not in (None, "default"):
            raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: llama3)")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # Plain attributes, not buffers: model.to(bfloat16) must not round the angles.
        self.cos = emb.cos()
        self.sin = emb.sin()
        # rotate_half(x) * sin == swap_halves(x) * signed_sin, exactly (negating is exact):
        # one flip per tensor instead of a negation and a concatenation.
        half = head_dim // 2
        self.signed_sin = torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotation of each token ([tokens, 1, head_dim] cos and signed sin), gathered once
        per step and shared by every layer. Rounded to `dtype` after the float32 products."""
        tables = self._tables.get(dtype)
        if tables is None:
            tables = self._tables[dtype] = (self.cos.to(dtype), self.signed_sin.to(dtype))
        cos, sin = tables
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    @staticmethod
    def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [tokens, heads, head_dim] -> x rotated by its token's angles."""
        cos, signed_sin = cos_sin
        swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)
        return x * cos + swapped * signed_sin

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos_sin = self.cos_sin(positions, q.dtype)
        return self.rotate(q, cos_sin), self.rotate(k, cos_sin)
