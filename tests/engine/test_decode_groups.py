"""Decode rows attended in groups of similar context length (kernels.attention.plan_decode_groups)
give what one group over the whole batch gives, and the plan covers every row once."""

from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata, paged_attention, plan_decode_groups

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8
SCALE = HEAD_DIM**-0.5


def _decode_batch(seq_lens: list[int], seed: int = 0):
    """Decode rows (sorted longest first, as the model runner packs them) over a random cache
    whose blocks are handed out in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    widths = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(widths) + 1
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for w in widths:
        tables.append(order[used : used + w])
        used += w
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=generator)
    query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(len(seq_lens), KV_HEADS, HEAD_DIM, generator=generator)
    value = torch.randn(len(seq_lens), KV_HEADS, HEAD_DIM, generator=generator)
    slots = [t[(n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK for t, n in zip(tables, seq_lens, strict=True)]
    width = max(widths)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(seq_lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_seq_lens=torch.tensor(seq_lens),
        decode_max_seq_len=max(seq_lens),
        prefill_seqs=[],
        prefill_block_tables=[],
    )
    return query, key, value, k_cache, v_cache, meta, tables


def test_plan_covers_every_row_once_in_order_and_bounds_the_padding():
    seq_lens = [61, 60, 58, 57, 40, 39, 33, 31, 30, 12, 11, 9, 3, 2]
    tables = [[0] * -(-n // BLOCK) for n in seq_lens]
    groups = plan_decode_groups(seq_lens, tables, BLOCK, torch.device("cpu"))
    assert len(groups) > 1
    assert [g.start for g in groups] == [0] + [g.end for g in groups[:-1]]
    assert groups[-1].end == len(seq_lens)
    for g in groups:
        assert g.max_seq_len == seq_lens[g.start]
        assert g.block_tables.shape == (g.end - g.start, -(-g.max_seq_len // BLOCK))
        if g.end - g.start > 4:  # past the minimum group size, no row is much shorter
            assert min(seq_lens[g.start : g.end]) > 0.75 * g.max_seq_len


def test_equal_lengths_form_one_group_without_a_mask():
    groups = plan_decode_groups([9] * 6, [[1, 2, 3]] * 6, BLOCK, torch.device("cpu"))
    assert len(groups) == 1
    assert groups[0].seq_lens is None and groups[0].attn_mask is None


def test_grouped_decode_attention_equals_one_group_over_the_batch():
    seq_lens = [61, 60, 47, 40, 39, 33, 31, 30, 12, 11, 9, 3, 2, 1]
    query, key, value, k_cache, v_cache, meta, tables = _decode_batch(seq_lens)
    expected = paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, SCALE)
    meta.decode_groups = plan_decode_groups(seq_lens, tables, BLOCK, torch.device("cpu"))
    assert len(meta.decode_groups) > 1
    out = paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, SCALE)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
