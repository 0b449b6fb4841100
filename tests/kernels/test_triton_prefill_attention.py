"""Triton mixed-step attention (kernels/triton: decode rows and varlen prefill over a paged
prefix) against the torch reference, through paged_attention's backend choice.

Without CUDA the kernels run under Triton's interpreter on small shapes (TRITON_INTERPRET=1,
set in conftest.py); the `gpu` tests run the same checks compiled on CUDA at real sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernels.attention import AttentionMetadata, paged_attention, uses_triton  # noqa: E402
from kernels.triton.prefill_attention import triton_prefill_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ULP = 2.0**-7
# bfloat16 error bound in ulps of the output's magnitude: on CUDA the probabilities are
# rounded to bf16 before the P.V product, as flash kernels do; the interpreter keeps float32.
BF16_ULPS = 2 if DEVICE == "cuda" else 1


def make_step(specs, num_heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    """One packed step: specs are (cached tokens, new tokens) per sequence, decode rows (one
    new token) first as the model runner packs them. The cache is garbage (x100) except the
    cached prefixes, so a read of a wrong slot shows; blocks are scattered, block 0 unused.
    Returns (query, key, value, k_cache, v_cache, meta)."""
    gen = torch.Generator().manual_seed(seed)
    specs = sorted(specs, key=lambda s: s[1] != 1)
    widths = [max(-(-(c + n) // block_size), 1) for c, n in specs]
    num_blocks = sum(widths) + 2
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen) * 100
    v_cache = torch.randn(shape, generator=gen) * 100
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[ids.pop() for _ in range(w)] for w in widths]
    tokens = sum(n for _, n in specs)
    query = torch.randn(tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen)
    slots, prefill_seqs, prefill_tables = [], [], []
    decode_tables, decode_lens, row = [], [], 0
    for (cached, new), table in zip(specs, tables, strict=True):
        if cached:  # the prefix, as an earlier step stored it
            pos = torch.arange(cached)
            blocks, offsets = torch.tensor(table)[pos // block_size], pos % block_size
            k_cache[blocks, offsets] = torch.randn(cached, kv_heads, head_dim, generator=gen)
            v_cache[blocks, offsets] = torch.randn(cached, kv_heads, head_dim, generator=gen)
        slots += [table[p // block_size] * block_size + p % block_size
                  for p in range(cached, cached + new)]
        if new == 1:
            decode_tables.append(table)
            decode_lens.append(cached + 1)
        else:
            prefill_seqs.append((row, new, cached + new))
            prefill_tables.append(torch.tensor(table, device=device))
        row += new
    width = max((len(t) for t in decode_tables), default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode_tokens=len(decode_lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                                         device=device) if decode_tables else None,
        decode_seq_lens=torch.tensor(decode_lens, device=device) if decode_lens else None,
        decode_max_seq_len=max(decode_lens, default=0),
        prefill_seqs=prefill_seqs,
        prefill_block_tables=prefill_tables,
    )
    to = dict(device=device, dtype=dtype)
    return (query.to(**to), key.to(**to), value.to(**to), k_cache.to(**to), v_cache.to(**to),
            meta)


def check_step(step, window, label):
    """The step through backend triton against backend torch on float32 copies: float32 to
    1e-5, bfloat16 to BF16_ULPS bf16 ulps of the output's magnitude (max error printed)."""
    query, key, value, k_cache, v_cache, meta = step
    scale = query.shape[-1] ** -0.5
    as_float = [t.float() for t in (query, key, value, k_cache, v_cache)]
    ref = paged_attention(*as_float, dataclasses.replace(meta, attention_backend="torch"),
                          scale, window)
    out = paged_attention(query, key, value, k_cache, v_cache,
                          dataclasses.replace(meta, attention_backend="triton"), scale, window)
    assert out.shape == query.shape and out.dtype == query.dtype
    err = (out.float() - ref).abs().max().item()
    bound = 1e-5 if query.dtype == torch.float32 else BF16_ULPS * BF16_ULP * ref.abs().max().item()
    print(f"{label}: max error {err:.3g} (bound {bound:.3g})")
    assert err <= bound, f"{label}: max error {err} over {bound}"
    # both backends stored this step's K/V into the same slots
    torch.testing.assert_close(k_cache.float(), as_float[3], atol=0, rtol=0)


# Blocks of 4: decode rows at a 1-token context, a block boundary (8) and past one (6); a
# fresh prefill, a chunk after a prefix ending on a block boundary, one whose prefix ends
# mid-block and crosses blocks, a 2-token chunk (more than one query: not a decode row).
MIXED = [(5, 1), (0, 1), (7, 1), (0, 7), (8, 5), (6, 10), (13, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 5], ids=["full", "window5"])
@pytest.mark.parametrize("group", [1, 3, 8], ids=["gqa1", "gqa3", "gqa8"])
def test_mixed_step_matches_reference(group, window, dtype):
    step = make_step(MIXED, 2 * group, 2, 16, 4, dtype, DEVICE)
    check_step(step, window, f"mixed gqa{group} window{window} {dtype}")


@pytest.mark.parametrize(("rows", "block_n"), [(16, 16), (64, 16)], ids=["16x16", "64x16"])
def test_prefill_only_step_with_small_tiles_matches_reference(rows, block_n):
    """Tiles of 16 keys (the CUDA minimum of tl.dot): several query tiles per sequence, key
    tiles across pages; head_dim 12 pads to 16. With 32 tokens a tile (64 rows, 2 heads per
    KV head) and a window of 6, a tile's later queries see no key of its first key tile."""
    query, key, value, k_cache, v_cache, meta = make_step(
        [(0, 9), (21, 11), (3, 37)], 4, 2, 12, 4, torch.float32, DEVICE, seed=2)
    scale = 12**-0.5
    for window in (0, 6):
        # the reference also stores this step's K/V, which the prefill kernel reads
        ref = paged_attention(query, key, value, k_cache, v_cache,
                              dataclasses.replace(meta, attention_backend="torch"), scale, window)
        tables = torch.nn.utils.rnn.pad_sequence(meta.prefill_block_tables, batch_first=True)
        out = triton_prefill_attention(query, k_cache, v_cache, meta.prefill_seqs, tables,
                                       scale, window, rows=rows, block_n=block_n)
        err = (out - ref).abs().max().item()
        print(f"tiles {rows}x{block_n} window{window}: max error {err:.3g}")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_empty_chunk_leaves_its_rows_and_others_exact():
    """A sequence with no new tokens this step reads nothing and writes no row."""
    query, key, value, k_cache, v_cache, meta = make_step(
        [(0, 6), (4, 3)], 4, 2, 16, 4, torch.float32, DEVICE, seed=3)
    store = paged_attention(query, key, value, k_cache, v_cache,
                            dataclasses.replace(meta, attention_backend="torch"), 0.25)
    seqs = [meta.prefill_seqs[0], (6, 0, 8), meta.prefill_seqs[1]]
    tables = torch.nn.utils.rnn.pad_sequence(
        [meta.prefill_block_tables[0], meta.prefill_block_tables[1], meta.prefill_block_tables[1]],
        batch_first=True)
    out = torch.full_like(query, 7.0)
    triton_prefill_attention(query, k_cache, v_cache, seqs, tables, 0.25, out=out, rows=16,
                             block_n=16)
    torch.testing.assert_close(out, store, atol=1e-5, rtol=1e-5)


def test_block_tables_too_short_for_a_context_are_refused_clearly():
    query, _, _, k_cache, v_cache, meta = make_step([(0, 6)], 4, 2, 16, 4, torch.float32, DEVICE)
    tables = torch.stack(meta.prefill_block_tables)[:, :1]
    with pytest.raises(ValueError, match="1 blocks of 4 cannot hold a context of 6 tokens"):
        triton_prefill_attention(query, k_cache, v_cache, meta.prefill_seqs, tables, 0.25)


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not uses_triton("auto", cpu)  # the CPU keeps its path
    assert not uses_triton("torch", cuda)
    assert uses_triton("triton", cpu)  # asked for: runs (interpreted here)
    assert uses_triton("auto", cuda)  # triton imports in this test module
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        uses_triton("flash", cpu)


def test_triton_backend_on_cpu_without_the_interpreter_is_refused_clearly(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton needs a CUDA device, not cpu"):
        uses_triton("triton", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 1024], ids=["full", "window1024"])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(32, 32), (24, 8), (32, 4)],
                         ids=["gqa1", "gqa3", "gqa8"])
def test_mixed_step_matches_reference_at_real_sizes_on_cuda(num_heads, kv_heads, window):
    """32 decode rows up to 4096 tokens beside chunked prefills over prefixes of 0 to 3000
    tokens (a 1-token context and block boundaries included), head_dim 128, blocks of 16,
    bfloat16."""
    gen = torch.Generator().manual_seed(4)
    decodes = [(n, 1) for n in torch.randint(0, 4096, (29,), generator=gen).tolist()]
    specs = decodes + [(0, 1), (16, 1), (4095, 1), (0, 2048), (1000, 512), (3000, 1024), (32, 17)]
    step = make_step(specs, num_heads, kv_heads, 128, 16, torch.bfloat16, "cuda")
    check_step(step, window, f"cuda mixed {num_heads}/{kv_heads} w{window}")
