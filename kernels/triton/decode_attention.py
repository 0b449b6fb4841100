"""Paged decode attention in Triton: one query token per sequence, K/V read in place from the
block table, the query heads of one KV head in one program, split-K over long contexts.

Reference and oracle: kernels/attention.py paged_decode_attention. Runs on CUDA, and on CPU
tensors under TRITON_INTERPRET=1 (the tests); every load is cast to float32 before arithmetic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Context tokens one split-K program covers at least; a context shorter than this is one split.
SPLIT_TOKENS = 512
MAX_SPLITS = 16
# Warps per split program. At 4, the default tiles used all 255 registers on sm_90 and spilled
# at head_dim 128 for every GQA ratio but 8 (244 B at 4, 604 B at 1); at 8 they take 180-220
# registers and spill nothing, with as many warps resident per SM (`python -m
# kernels.triton.compile_check --all`, which reads ptxas).
NUM_WARPS = 8


def decode_block_n(group_pad: int, dim_pad: int) -> int:
    """Context tokens per tile: the broadcast product holds GROUP_PAD x BLOCK_N x DIM_PAD
    floats, about 16k per program."""
    return min(64, max(16, 16384 // (group_pad * dim_pad)))


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr,
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    scale, window,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Program (b, kv_head, split): query heads kv_head*GROUP + [0, GROUP) of sequence b over
    its split's share of the visible context. One split writes the output; several write the
    unnormalized partial (max, sum, acc) for _decode_reduce_kernel."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # Split boundaries on BLOCK_N multiples of the visible range [lo, seq_len).
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    begin = lo + split * per_split
    end = tl.minimum(begin + per_split, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(begin, end, BLOCK_N):
        pos = start + cols
        tok_ok = pos < end
        block_ids = tl.load(tables_ptr + b * stride_tb + pos // BLOCK_SIZE, mask=tok_ok, other=0)
        block_ids = block_ids.to(tl.int64)
        offsets = pos % BLOCK_SIZE
        kv_mask = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + block_ids[:, None] * stride_kb + offsets[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        # [GROUP_PAD, BLOCK_N]: a broadcast product, since a group is often below tl.dot's 16 rows
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(tok_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(v_cache_ptr + block_ids[:, None] * stride_vb + offsets[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        denom = denom * alpha + tl.sum(p, axis=1)
        m = m_new

    out_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / denom[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials laid out [B, heads, NUM_SPLITS] and [B, heads, NUM_SPLITS, DIM_PAD]
        part = (b * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m, mask=row_ok)
        tl.store(part_sum_ptr + part, denom, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * DIM_PAD + dims[None, :], acc, mask=out_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    stride_ob, stride_oh, num_heads,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Program (b, head): combine the NUM_SPLITS partials of one query head. An empty split
    (max -inf, sum 0) weighs exp(-inf) = 0; every sequence has at least one non-empty split."""
    b = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, DIM_PAD)
    part = (b * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(part_max_ptr + part)
    denom = tl.load(part_sum_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * DIM_PAD + dims[None, :])
    m_all = tl.max(m, axis=0)
    w = tl.exp(m - m_all)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(denom * w, axis=0)
    tl.store(out_ptr + b * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def num_decode_splits(max_seq_len: int, window: int = 0) -> int:
    """Split-K factor for a batch: one per SPLIT_TOKENS of the longest visible context, a power
    of two (the reduce kernel's tile), at most MAX_SPLITS."""
    visible = min(max_seq_len, window) if window else max_seq_len
    wanted = min(-(-visible // SPLIT_TOKENS), MAX_SPLITS)
    return triton.next_power_of_2(max(wanted, 1))


def triton_paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | None,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as kernels.attention.paged_decode_attention (query [B, heads, D] ->
    [B, heads, D]; seq_lens None: every context is max_seq_len long), written into `out` when
    given (a [B, heads, D] view whose head_dim is contiguous). num_splits / block_n override
    the split-K factor and the tokens per tile (tests use them on small shapes)."""
    batch, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {kv_heads} KV heads evenly")
    if block_tables.shape[-1] * block_size < max_seq_len:
        # the kernel would read past the table's end: on a GPU a fault that ends the process
        raise ValueError(f"block tables of {block_tables.shape[-1]} blocks of {block_size} "
                         f"cannot hold a context of {max_seq_len} tokens")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")
    query, block_tables = query.contiguous(), block_tables.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if batch == 0:
        return out
    if seq_lens is None:
        seq_lens = torch.full((batch,), max_seq_len, dtype=torch.long, device=query.device)
    group = num_heads // kv_heads
    dim_pad = triton.next_power_of_2(head_dim)
    splits = num_splits or num_decode_splits(max_seq_len, window)
    if splits & (splits - 1):
        raise ValueError(f"num_splits must be a power of two, not {splits}")
    group_pad = triton.next_power_of_2(group)
    block_n = block_n or decode_block_n(group_pad, dim_pad)
    if splits > 1:
        part_max = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((batch, num_heads, splits, dim_pad), dtype=torch.float32,
                               device=query.device)
    else:
        part_max = part_sum = part_acc = out  # unused by the one-split kernel
    _decode_split_kernel[(batch, kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_max, part_sum, part_acc,
        float(scale), int(window),
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=splits, num_warps=NUM_WARPS,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            out, part_max, part_sum, part_acc, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=splits,
        )
    return out
