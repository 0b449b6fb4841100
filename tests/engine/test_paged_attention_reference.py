"""kernels.attention (the torch reference every other kernel is checked against) against a
naive per-token, per-head attention loop: decode tokens, fresh prefills and prefills over a
cached prefix in one packed batch, grouped-query heads, scattered and padded block tables."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.attention import AttentionMetadata, paged_attention, store_kv

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8  # three query heads per KV head
NUM_BLOCKS = 32
SCALE = HEAD_DIM**-0.5


@dataclass
class Sequence:
    """One sequence of the batch: `num_cached` tokens already in the cache, `num_new` now."""

    num_cached: int
    num_new: int
    block_ids: list[int]
    q: torch.Tensor = None  # [num_new, HEADS, D]
    k: torch.Tensor = None  # [num_cached + num_new, KV_HEADS, D], the whole context
    v: torch.Tensor = None

    @property
    def ctx_len(self) -> int:
        return self.num_cached + self.num_new

    def slot(self, pos: int) -> int:
        return self.block_ids[pos // BLOCK] * BLOCK + pos % BLOCK


def naive_attention(seq: Sequence, window: int = 0) -> torch.Tensor:
    """Query i sits at absolute position num_cached + i and attends to positions 0..itself
    (with a window, the `window` positions up to itself); query head h reads KV head
    h // (HEADS // KV_HEADS), as transformers' repeat_kv does."""
    group = HEADS // KV_HEADS
    out = torch.empty(seq.num_new, HEADS, HEAD_DIM, dtype=torch.float64)
    for i in range(seq.num_new):
        pos = seq.num_cached + i
        first = max(0, pos + 1 - window) if window else 0
        for h in range(HEADS):
            q = seq.q[i, h].double()
            keys = seq.k[first : pos + 1, h // group].double()
            values = seq.v[first : pos + 1, h // group].double()
            weights = torch.softmax(keys @ q * SCALE, dim=0)
            out[i, h] = weights @ values
    return out


def build_batch(seqs: list[Sequence], seed: int = 0):
    """Random Q/K/V; the cached part of each context written into a cache full of garbage;
    decode sequences (one new token) first, as the model runner packs them."""
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=generator) * 100
    v_cache = torch.randn(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=generator) * 100
    for seq in seqs:
        assert len(seq.block_ids) * BLOCK >= seq.ctx_len
        seq.q = torch.randn(seq.num_new, HEADS, HEAD_DIM, generator=generator)
        seq.k = torch.randn(seq.ctx_len, KV_HEADS, HEAD_DIM, generator=generator)
        seq.v = torch.randn(seq.ctx_len, KV_HEADS, HEAD_DIM, generator=generator)
        for pos in range(seq.num_cached):
            k_cache.view(-1, KV_HEADS, HEAD_DIM)[seq.slot(pos)] = seq.k[pos]
            v_cache.view(-1, KV_HEADS, HEAD_DIM)[seq.slot(pos)] = seq.v[pos]
    decodes = [s for s in seqs if s.num_new == 1]
    others = [s for s in seqs if s.num_new != 1]
    ordered = decodes + others
    query = torch.cat([s.q for s in ordered])
    key = torch.cat([s.k[s.num_cached :] for s in ordered])
    value = torch.cat([s.v[s.num_cached :] for s in ordered])
    slots = [s.slot(p) for s in ordered for p in range(s.num_cached, s.ctx_len)]
    prefill_seqs, start = [], len(decodes)
    for s in others:
        prefill_seqs.append((start, s.num_new, s.ctx_len))
        start += s.num_new
    width = max((len(s.block_ids) for s in decodes), default=0)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decode_tokens=len(decodes),
        # Padded with block 0, whose garbage must be masked out.
        decode_block_tables=torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in decodes])
        if decodes else None,
        decode_seq_lens=torch.tensor([s.ctx_len for s in decodes]) if decodes else None,
        decode_max_seq_len=max((s.ctx_len for s in decodes), default=0),
        prefill_seqs=prefill_seqs,
        prefill_block_tables=[torch.tensor(s.block_ids) for s in others],
    )
    return ordered, query, key, value, k_cache, v_cache, meta


def check(seqs: list[Sequence], window: int = 0) -> None:
    ordered, query, key, value, k_cache, v_cache, meta = build_batch(seqs)
    out = paged_attention(query, key, value, k_cache, v_cache, meta, SCALE, window)
    assert out.shape == query.shape
    row = 0
    for seq in ordered:
        expected = naive_attention(seq, window)
        torch.testing.assert_close(out[row : row + seq.num_new].double(), expected, atol=1e-5, rtol=1e-5)
        row += seq.num_new
    # The new tokens' K/V now sit in their slots.
    for seq in ordered:
        for pos in range(seq.num_cached, seq.ctx_len):
            assert torch.equal(k_cache.view(-1, KV_HEADS, HEAD_DIM)[seq.slot(pos)], seq.k[pos])
            assert torch.equal(v_cache.view(-1, KV_HEADS, HEAD_DIM)[seq.slot(pos)], seq.v[pos])


def test_mixed_batch_of_decodes_fresh_prefills_and_cached_prefix_prefills():
    check([
        Sequence(num_cached=8, num_new=1, block_ids=[5, 2, 9]),  # decode, context 9
        Sequence(num_cached=0, num_new=7, block_ids=[11, 3]),  # fresh prefill
        Sequence(num_cached=3, num_new=1, block_ids=[17]),  # decode inside its first block
        Sequence(num_cached=5, num_new=6, block_ids=[20, 7, 14]),  # chunk after a cached prefix
        Sequence(num_cached=12, num_new=4, block_ids=[1, 4, 6, 8]),  # chunk filling a block
    ])


@pytest.mark.parametrize("window", [1, 3, 4, 9, 100])
def test_sliding_window_sees_only_the_latest_keys(window):
    check([
        Sequence(num_cached=8, num_new=1, block_ids=[5, 2, 9]),
        Sequence(num_cached=0, num_new=7, block_ids=[11, 3]),
        Sequence(num_cached=14, num_new=1, block_ids=[18, 19, 21, 22]),
        Sequence(num_cached=5, num_new=6, block_ids=[20, 7, 14]),
        Sequence(num_cached=12, num_new=4, block_ids=[1, 4, 6, 8]),
    ], window)


def test_sliding_window_in_a_decode_only_batch_of_one():
    # Batch 1 with no lengths (nothing to pad): the window still needs a mask of its own.
    ordered, query, key, value, k_cache, v_cache, meta = build_batch(
        [Sequence(num_cached=10, num_new=1, block_ids=[3, 4, 5])])
    meta.decode_seq_lens = None
    out = paged_attention(query, key, value, k_cache, v_cache, meta, SCALE, 4)
    torch.testing.assert_close(out.double(), naive_attention(ordered[0], 4), atol=1e-5, rtol=1e-5)


def test_decode_only_batch_with_different_context_lengths():
    check([
        Sequence(num_cached=0, num_new=1, block_ids=[3]),  # a one-token prompt
        Sequence(num_cached=14, num_new=1, block_ids=[9, 1, 30, 2]),
        Sequence(num_cached=4, num_new=1, block_ids=[6, 7]),  # first token of a new block
    ])


def test_prefill_only_batch():
    check([
        Sequence(num_cached=0, num_new=13, block_ids=[4, 2, 8, 10]),
        Sequence(num_cached=8, num_new=2, block_ids=[12, 13, 15]),
    ])


def test_long_context_over_many_scattered_blocks():
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    check([
        Sequence(num_cached=60, num_new=1, block_ids=blocks[:16]),
        Sequence(num_cached=40, num_new=9, block_ids=blocks[16:]),
    ])


@pytest.mark.parametrize("num_new", [1, 2, 5])
def test_query_heads_read_their_own_kv_head(num_new):
    # Make each KV head's values constant and distinct: every query head's output must equal
    # the value of the KV head it belongs to (h // 3), whatever the attention weights are.
    seq = Sequence(num_cached=3, num_new=num_new, block_ids=[0, 1, 2])
    ordered, query, key, value, k_cache, v_cache, meta = build_batch([seq])
    for kv_head in range(KV_HEADS):
        value[:, kv_head] = kv_head + 1.0
        v_cache[:, :, kv_head] = kv_head + 1.0
    out = paged_attention(query, key, value, k_cache, v_cache, meta, SCALE)
    for h in range(HEADS):
        torch.testing.assert_close(out[:, h], torch.full((num_new, HEAD_DIM), h // 3 + 1.0))


def test_store_kv_writes_each_token_to_its_slot_only():
    k_cache = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros(4, BLOCK, KV_HEADS, HEAD_DIM)
    key = torch.arange(3 * KV_HEADS * HEAD_DIM, dtype=torch.float32).view(3, KV_HEADS, HEAD_DIM) + 1
    store_kv(key, -key, k_cache, v_cache, torch.tensor([13, 2, 7]))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[3, 1], -key[0])
    assert torch.equal(k_cache[0, 2], key[1])
    assert torch.equal(k_cache[1, 3], key[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3


def test_softmax_is_scaled_by_the_given_scale():
    seq = Sequence(num_cached=4, num_new=1, block_ids=[0, 1])
    ordered, query, key, value, k_cache, v_cache, meta = build_batch([seq])
    out_default = paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, SCALE)
    out_other = paged_attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, SCALE * 3)
    assert not torch.allclose(out_default, out_other)
