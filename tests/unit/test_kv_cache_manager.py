"""KVCacheManager: prefix-cache hits in whole blocks, slot allocation, caching and freeing,
checked with exact block ids on an eleven-block pool (block size 4)."""

from __future__ import annotations

from engine.block_pool import hash_prompt_blocks
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BLOCK = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _prefill(kv: KVCacheManager, request: Request) -> list[int]:
    """Schedule the whole uncached prompt at once, as the scheduler does for a short prompt."""
    hits, num_hit = kv.get_computed_blocks(request)
    new_ids = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return new_ids


def test_first_request_gets_fresh_blocks_and_no_hit():
    kv = KVCacheManager(11, BLOCK)
    request = _request("a", list(range(10)))
    assert kv.get_computed_blocks(request) == ([], 0)
    assert _prefill(kv, request) == [0, 1, 2]
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 8


def test_only_full_blocks_are_cached():
    kv = KVCacheManager(11, BLOCK)
    request = _request("a", list(range(10)))
    _prefill(kv, request)
    assert kv.pool.num_cached_blocks == 2
    assert [kv.pool.blocks[i].block_hash for i in (0, 1)] == request.block_hashes
    assert kv.pool.blocks[2].block_hash is None


def test_shared_prefix_hits_the_same_block_ids_and_shares_them():
    kv = KVCacheManager(11, BLOCK)
    _prefill(kv, _request("a", list(range(10))))
    b = _request("b", list(range(8)) + [50, 51, 52])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    assert kv.allocate_slots(b, 3, hits) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # A lookup counts nothing by itself: the scheduler records the one that admits a request.
    assert kv.prefix_queries == 0 and kv.prefix_hits == 0


def test_hit_stops_at_the_first_block_that_differs():
    kv = KVCacheManager(11, BLOCK)
    _prefill(kv, _request("a", list(range(12))))
    b = _request("b", [0, 1, 2, 3, 99, 5, 6, 7, 8, 9, 10, 11, 12])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0] and num_hit == 4


def test_a_fully_cached_prompt_leaves_its_last_token_to_compute():
    kv = KVCacheManager(11, BLOCK)
    _prefill(kv, _request("a", list(range(8))))
    b = _request("b", list(range(8)))
    hits, num_hit = kv.get_computed_blocks(b)
    # Block 1 holds the last token, whose logits are needed: it is recomputed in a new block.
    assert [blk.block_id for blk in hits] == [0] and num_hit == 4
    assert kv.allocate_slots(b, 4, hits) == [2]


def test_freed_cached_blocks_are_hit_again_until_evicted():
    kv = KVCacheManager(4, BLOCK)
    a = _request("a", list(range(10)))
    _prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = _request("b", list(range(10)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8
    # Adopting two free cached blocks plus one new block fits exactly in the four blocks.
    assert kv.allocate_slots(b, 2, hits) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.num_free_blocks == 1


def test_request_blocks_are_freed_tail_first_so_prefix_heads_are_evicted_last():
    kv = KVCacheManager(3, BLOCK)
    a = _request("a", list(range(12)))
    _prefill(kv, a)
    kv.free(a)
    # Free queue is now 2, 1, 0: a one-block allocation evicts the tail block (2).
    c = _request("c", [90, 91])
    assert kv.allocate_slots(c, 2) == [2]
    b = _request("b", list(range(12)) + [12])
    hits, num_hit = kv.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1] and num_hit == 8


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_short():
    kv = KVCacheManager(4, BLOCK)
    _prefill(kv, _request("a", list(range(8))))
    b = _request("b", list(range(8)) + list(range(100, 110)))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = [(blk.block_id, blk.ref_cnt) for blk in kv.pool.blocks]
    assert kv.allocate_slots(b, 10, hits) is None  # needs 3 new blocks, 2 free
    assert [(blk.block_id, blk.ref_cnt) for blk in kv.pool.blocks] == before
    assert kv.block_ids("b") == [] and kv.num_free_blocks == 2


def test_freeing_a_request_without_blocks_is_a_no_op():
    kv = KVCacheManager(4, BLOCK)
    kv.free(_request("x", [0]))
    assert kv.num_free_blocks == 4


def test_adopting_free_cached_hits_counts_them_against_the_free_pool():
    kv = KVCacheManager(3, BLOCK)
    a = _request("a", list(range(8)))
    _prefill(kv, a)
    kv.free(a)
    b = _request("b", list(range(8)) + list(range(100, 108)))
    hits, _ = kv.get_computed_blocks(b)
    # Two hits (free) + two new blocks = 4 > 3: must refuse rather than over-allocate.
    assert kv.allocate_slots(b, 8, hits) is None
    assert kv.num_free_blocks == 3


def test_decode_tokens_take_a_new_block_only_at_a_block_boundary():
    kv = KVCacheManager(11, BLOCK)
    a = _request("a", list(range(7)))
    _prefill(kv, a)
    assert kv.block_ids("a") == [0, 1]
    a.append_output_token(100)  # token 8 fits in block 1
    assert kv.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    kv.cache_blocks(a)
    assert kv.pool.num_cached_blocks == 2
    a.append_output_token(101)  # token 9 needs block 2
    assert kv.allocate_slots(a, 1) == [2]


def test_cache_blocks_registers_output_blocks_with_the_chained_hash():
    kv = KVCacheManager(11, BLOCK)
    a = _request("a", [1, 2, 3])
    _prefill(kv, a)
    a.append_output_token(4)
    kv.allocate_slots(a, 1)
    a.num_computed_tokens = 4
    kv.cache_blocks(a)
    assert kv.pool.blocks[0].block_hash == hash_prompt_blocks([1, 2, 3, 4], BLOCK)[0]


def test_free_returns_every_block_and_shared_blocks_keep_their_other_owner():
    kv = KVCacheManager(11, BLOCK)
    a, b = _request("a", list(range(10))), _request("b", list(range(9)))
    _prefill(kv, a)
    _prefill(kv, b)
    assert kv.block_ids("b") == [0, 1, 3]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    kv.free(b)
    assert kv.num_free_blocks == 11
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_trim_releases_blocks_past_the_kept_tokens():
    kv = KVCacheManager(11, BLOCK)
    a = _request("a", list(range(10)))
    _prefill(kv, a)
    kv.trim(a, 5)
    assert kv.block_ids("a") == [0, 1]
    assert kv.num_free_blocks == 9


def test_prefix_caching_disabled_never_hits():
    kv = KVCacheManager(11, BLOCK, enable_prefix_caching=False)
    _prefill(kv, _request("a", list(range(10))))
    assert kv.get_computed_blocks(_request("b", list(range(10)))) == ([], 0)
    assert kv.pool.num_cached_blocks == 0
