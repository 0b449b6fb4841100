"""Varlen prefill / mixed-step attention in Triton: packed sequences whose new tokens' K/V are
already in the paged cache with their cached prefix (chunked prefill, prefix hits and
speculative verification alike), causal within the new tokens, optional sliding window.

Reference and oracle: kernels/attention.py paged_attention (its prefill rows) and
prefill_attention. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Query rows (tokens x the query heads of one KV head) and keys per tile on CUDA, and warps
# per program. At 4 warps the bfloat16 tile spilled 972-1,228 B of registers on sm_90 (head_dim
# 128) and the float32 one (exact products, not tensor cores: the parity runs) 29-32 KB, taking
# 12 s to compile; at 8 warps, with 16 keys a tile in float32, none spills and each compiles in
# about a second (`python -m kernels.triton.compile_check --all`, which reads ptxas).
ROWS = 64
BLOCK_N = 64
BLOCK_N_FP32 = 16
NUM_WARPS = 8


def prefill_block_n(dtype: torch.dtype, device: torch.device) -> int:
    """Keys per tile (the interpreter, on CPU, keeps the wider tile: fewer, larger numpy ops)."""
    return BLOCK_N_FP32 if dtype == torch.float32 and device.type == "cuda" else BLOCK_N


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, q_starts_ptr, q_lens_ptr, ctx_lens_ptr, out_ptr,
    scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (seq, kv_head, tile): new tokens [tile*BLOCK_M, +BLOCK_M) of one sequence, each
    with the GROUP query heads of one KV head as rows, over the keys any of them may see."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(q_starts_ptr + seq).to(tl.int32)
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    ctx_len = tl.load(ctx_lens_ptr + seq).to(tl.int32)
    cached = ctx_len - q_len  # query i sits at absolute position cached + i

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    tok = tile * BLOCK_M + rows // GROUP_PAD
    head_in_group = rows % GROUP_PAD
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    heads = kv_head * GROUP + head_in_group
    q_pos = cached + tok
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt
                + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    first = tile * BLOCK_M
    last = tl.minimum(first + BLOCK_M, q_len) - 1
    lo = tl.where(window > 0, tl.maximum(cached + first - window + 1, 0), 0)
    hi = tl.where(first < q_len, cached + last + 1, lo)  # an empty tile reads nothing

    m = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, DIM_PAD], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + cols
        k_ok = k_pos < hi
        block_ids = tl.load(tables_ptr + seq * stride_tb + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        block_ids = block_ids.to(tl.int64)
        offsets = k_pos % BLOCK_SIZE
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + block_ids[:, None] * stride_kb + offsets[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block_ids[:, None] * stride_vb + offsets[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if window > 0:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        # a row that has seen no key yet (window) keeps max -inf: subtract 0 instead of -inf
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_use)
        p = tl.exp(scores - m_use[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]  # rows past q_len saw nothing
    tl.store(out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot
             + heads[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def triton_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqs: list[tuple[int, int, int]],
    block_tables: torch.Tensor,
    scale: float,
    window: int = 0,
    out: torch.Tensor | None = None,
    rows: int | None = None,
    block_n: int | None = None,
    seq_info: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed new tokens over their sequences' paged contexts, into `out`.

    query: [tokens, heads, D]; seqs: (query start, query length, context length incl. the
    queries) per sequence, as AttentionMetadata.prefill_seqs; block_tables: [len(seqs),
    blocks] (0-padded); the new tokens' K/V must already be in the cache (store_kv). Rows of
    `out` outside the seqs are left as they are. seq_info: the seqs as a [3, len(seqs)] int
    tensor on the device (starts, query lengths, context lengths) when the caller has one
    (built here otherwise: three copies to the device, each a sync on a GPU). rows / block_n
    override the tile (tests)."""
    _, num_heads, head_dim = query.shape
    _, block_size, kv_heads, _ = k_cache.shape
    if num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads do not share {kv_heads} KV heads evenly")
    if len(seqs) != block_tables.shape[0]:
        raise ValueError(f"{len(seqs)} sequences but {block_tables.shape[0]} block tables")
    if out is None:
        out = torch.empty_like(query)
    if not seqs:
        return out
    longest = max(ctx_len for _, _, ctx_len in seqs)
    if block_tables.shape[1] * block_size < longest:
        # the kernel would read past the table's end: on a GPU a fault that ends the process
        raise ValueError(f"block tables of {block_tables.shape[1]} blocks of {block_size} "
                         f"cannot hold a context of {longest} tokens")
    device = query.device
    block_tables = block_tables.contiguous()
    if seq_info is None:
        seq_info = torch.tensor(list(zip(*seqs, strict=True)), dtype=torch.long, device=device)
    elif seq_info.shape != (3, len(seqs)):
        raise ValueError(f"seq_info of shape {tuple(seq_info.shape)} for {len(seqs)} sequences")
    starts, q_lens, ctx_lens = seq_info
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max((rows or ROWS) // group_pad, 1)
    max_q_len = max(q_len for _, q_len, _ in seqs)
    upcast = device.type == "cpu"  # the interpreter: no bfloat16 arithmetic in numpy
    grid = (len(seqs), kv_heads, max(triton.cdiv(max_q_len, block_m), 1))
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, starts, q_lens, ctx_lens, out,
        float(scale), int(window),
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, DIM_PAD=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n or prefill_block_n(query.dtype, device),
        UPCAST=upcast, PRECISION="ieee" if query.dtype == torch.float32 else None,
        num_warps=NUM_WARPS,
    )
    return out
