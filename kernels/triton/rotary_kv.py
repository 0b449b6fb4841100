"""Rotary embedding fused with the KV-cache write in Triton: one program per token rotates its
query and key heads and writes the rotated keys and the values into the paged cache at the
token's slot; a negative slot (a padding row) writes nothing.

Reference and oracle: engine/layers/rotary.py RotaryEmbedding.rotate, then kernels/attention.py
store_kv. Rounding follows the reference in the model's dtype: each product and the sum round
to it (bfloat16 on the bits, as kernels/triton/rounding.py says). Runs on CUDA, and on CPU
under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton.rounding import round_bf16


@triton.jit
def _rotate_heads(x_ptr, stride_xh, cos, sin, heads, dims, partner, ok, BF16: tl.constexpr):
    """[HEADS_PAD, DIM_PAD] tile of one token's heads rotated: x * cos + swap_halves(x) * sin."""
    x = tl.load(x_ptr + heads[:, None] * stride_xh + dims[None, :], mask=ok, other=0.0)
    swapped = tl.load(x_ptr + heads[:, None] * stride_xh + partner[None, :], mask=ok, other=0.0)
    a = round_bf16(x.to(tl.float32) * cos[None, :], BF16)
    b = round_bf16(swapped.to(tl.float32) * sin[None, :], BF16)
    return round_bf16(a + b, BF16)


@triton.jit
def _rotary_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, slots_ptr,
    q_out_ptr, k_cache_ptr, v_cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ct, stride_st, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    KV_HEADS: tl.constexpr, KV_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BF16: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    half: tl.constexpr = HEAD_DIM // 2
    partner = tl.where(dims < half, dims + half, dims - half)
    cos = tl.load(cos_ptr + t * stride_ct + dims, mask=dim_ok, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_st + dims, mask=dim_ok, other=0.0).to(tl.float32)

    heads = tl.arange(0, HEADS_PAD)
    ok = (heads < NUM_HEADS)[:, None] & dim_ok[None, :]
    q = _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, heads, dims, partner, ok, BF16)
    tl.store(q_out_ptr + t * stride_ot + heads[:, None] * stride_oh + dims[None, :],
             q.to(q_out_ptr.dtype.element_ty), mask=ok)

    slot = tl.load(slots_ptr + t)
    if slot >= 0:
        kv = tl.arange(0, KV_PAD)
        kv_ok = (kv < KV_HEADS)[:, None] & dim_ok[None, :]
        k = _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, kv, dims, partner, kv_ok,
                          BF16)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
        tl.store(k_dst + kv[:, None] * stride_kch + dims[None, :],
                 k.to(k_cache_ptr.dtype.element_ty), mask=kv_ok)
        v = tl.load(v_ptr + t * stride_vt + kv[:, None] * stride_vh + dims[None, :], mask=kv_ok)
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
        tl.store(v_dst + kv[:, None] * stride_vch + dims[None, :], v, mask=kv_ok)


def triton_rotary_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """query: [tokens, heads, D]; key/value: [tokens, kv_heads, D] (views of the qkv projection
    are fine: any token and head stride); cos/signed_sin: [tokens, D] or [tokens, 1, D]
    (RotaryEmbedding.cos_sin); k_cache/v_cache: [blocks, block_size, kv_heads, D];
    slot_mapping: [tokens] int, -1 for a row whose K/V is not stored -> the rotated query
    ([tokens, heads, D], contiguous). The rotated keys and the values land in the cache."""
    tokens, num_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    if key.shape != (tokens, kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} do not match "
                         f"query {tuple(query.shape)}")
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, not {head_dim}")
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {kv_heads} KV heads")
    if k_cache.shape[2:] != (kv_heads, head_dim) or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache {tuple(k_cache.shape)} / {tuple(v_cache.shape)} does not hold "
                         f"{kv_heads} KV heads of {head_dim}")
    if k_cache.dtype != key.dtype or v_cache.dtype != value.dtype:
        raise ValueError(f"cache dtype {k_cache.dtype} differs from the new K/V's {key.dtype}")
    if slot_mapping.shape != (tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} for {tokens} tokens")
    cos = cos.reshape(tokens, head_dim)
    signed_sin = signed_sin.reshape(tokens, head_dim)
    tensors = (query, key, value, cos, signed_sin, k_cache, v_cache)
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError("the last (head_dim) dimension of every input must be contiguous")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if tokens:
        _rotary_kv_kernel[(tokens,)](
            query, key, value, cos, signed_sin, slot_mapping, out, k_cache, v_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), cos.stride(0), signed_sin.stride(0),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_HEADS=num_heads, HEADS_PAD=triton.next_power_of_2(num_heads),
            KV_HEADS=kv_heads, KV_PAD=triton.next_power_of_2(kv_heads),
            HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=k_cache.shape[1], BF16=query.dtype == torch.bfloat16,
        )
    return out
