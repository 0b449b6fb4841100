"""BlockPool: exact block ids, reference counts, LRU eviction of free cached blocks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.block_pool import (
    ROOT_HASH,
    BlockPool,
    hash_block_tokens,
    hash_prompt_blocks,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _cache(pool: BlockPool, block_id: int, parent: int, tokens: tuple[int, ...]) -> int:
    block_hash = hash_block_tokens(parent, tokens)
    pool.cache_block(pool.blocks[block_id], block_hash, tokens)
    return block_hash


def test_allocate_hands_out_lowest_free_ids_first_with_one_reference():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 2


def test_freed_blocks_go_to_the_back_of_the_free_queue_in_the_order_given():
    pool = BlockPool(5)
    blocks = pool.allocate(3)
    pool.free(reversed(blocks))  # tail first, as KVCacheManager does
    assert pool.num_free_blocks == 5
    # Never-used blocks 3, 4 come first, then 2, 1, 0 in the order they were freed.
    assert [b.block_id for b in pool.allocate(5)] == [3, 4, 2, 1, 0]


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert [b.block_id for b in pool.allocate(1)] == [2]


def test_double_free_is_an_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free of block 0"):
        pool.free([block])


def test_shared_block_returns_to_the_free_queue_only_when_the_last_reference_drops():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    _cache(pool, 0, ROOT_HASH, (1, 2))
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3
    pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4


def test_cached_block_is_found_by_hash_and_tokens_and_survives_being_freed():
    pool = BlockPool(4)
    (block,) = pool.allocate(1)
    block_hash = _cache(pool, 0, ROOT_HASH, (7, 8))
    pool.free([block])
    assert pool.get_cached_block(block_hash, (7, 8)) is block
    assert pool.num_cached_blocks == 1


def test_hash_collision_with_different_tokens_is_a_miss():
    pool = BlockPool(4)
    pool.allocate(1)
    block_hash = _cache(pool, 0, ROOT_HASH, (7, 8))
    assert pool.get_cached_block(block_hash, (7, 9)) is None
    assert pool.get_cached_block(block_hash + 1, (7, 8)) is None


def test_touch_takes_a_free_cached_block_out_of_the_free_queue():
    pool = BlockPool(3)
    (block,) = pool.allocate(1)
    _cache(pool, 0, ROOT_HASH, (1,))
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 2
    # Block 0 is in use again, so allocation must skip it.
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]


def test_eviction_reuses_the_oldest_freed_cached_block_first():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    hashes = {}
    parent = ROOT_HASH
    for b in blocks:
        parent = hashes[b.block_id] = _cache(pool, b.block_id, parent, (b.block_id,))
    pool.free([blocks[2]])
    pool.free([blocks[0]])
    pool.free([blocks[3]])
    (reused,) = pool.allocate(1)
    assert reused.block_id == 2
    assert reused.block_hash is None and reused.token_ids is None
    assert pool.get_cached_block(hashes[2], (2,)) is None
    # The others stay findable until their own turn comes.
    assert pool.get_cached_block(hashes[0], (0,)) is blocks[0]
    assert pool.get_cached_block(hashes[3], (3,)) is blocks[3]
    assert [b.block_id for b in pool.allocate(2)] == [0, 3]
    assert pool.num_cached_blocks == 1  # block 1 is still held, and cached


def test_a_second_block_with_the_same_hash_does_not_replace_the_canonical_copy():
    pool = BlockPool(3)
    first, second = pool.allocate(2)
    block_hash = _cache(pool, 0, ROOT_HASH, (5, 5))
    _cache(pool, 1, ROOT_HASH, (5, 5))
    assert pool.get_cached_block(block_hash, (5, 5)) is first
    assert second.block_hash is None
    # Evicting the duplicate (never registered) must not drop the canonical copy.
    pool.free([second])
    pool.allocate(2)
    assert pool.get_cached_block(block_hash, (5, 5)) is first


def test_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_caching=False)
    pool.allocate(1)
    block_hash = _cache(pool, 0, ROOT_HASH, (1,))
    assert pool.get_cached_block(block_hash, (1,)) is None
    assert pool.num_cached_blocks == 0


def test_reset_prefix_cache_forgets_free_cached_blocks_but_not_held_ones():
    pool = BlockPool(3)
    held, freed = pool.allocate(2)
    held_hash = _cache(pool, 0, ROOT_HASH, (1,))
    freed_hash = _cache(pool, 1, held_hash, (2,))
    pool.free([freed])
    assert pool.reset_prefix_cache() == 1
    assert pool.get_cached_block(freed_hash, (2,)) is None
    assert pool.get_cached_block(held_hash, (1,)) is held


def test_events_record_stored_and_evicted_hashes_when_enabled():
    pool = BlockPool(1)
    pool.record_events = True
    (block,) = pool.allocate(1)
    block_hash = _cache(pool, 0, ROOT_HASH, (3,))
    pool.free([block])
    pool.allocate(1)
    assert list(pool.events) == [("stored", block_hash), ("evicted", block_hash)]


def test_zero_blocks_is_rejected():
    with pytest.raises(ValueError, match="at least one KV block"):
        BlockPool(0)


def test_block_hashes_chain_so_equal_blocks_after_different_prefixes_differ():
    a = hash_prompt_blocks([1, 2, 3, 4, 9, 9], block_size=2)
    b = hash_prompt_blocks([1, 2, 5, 6, 9, 9], block_size=2)
    assert len(a) == 3
    assert a[0] == b[0]
    assert a[2] != b[2]  # same tokens (9, 9), different parents
    assert hash_prompt_blocks([1, 2, 3], block_size=2) == a[:1]  # partial blocks are not hashed


def test_block_hashes_are_stable_across_processes():
    code = "from engine.block_pool import hash_prompt_blocks; print(hash_prompt_blocks([5, 6, 7, 8], 2))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": seed}, cwd=REPO_ROOT,
        ).stdout
        for seed in ("1", "2")
    }
    assert outputs == {f"{hash_prompt_blocks([5, 6, 7, 8], 2)}\n"}


def test_scheduling_modules_import_no_torch():
    code = (
        "import sys; import engine.block_pool, engine.kv_cache_manager, engine.scheduler, "
        "engine.request, engine.sampling_params, engine.outputs; "
        "sys.exit('torch' in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_high_water_counts_the_blocks_ever_handed_out():
    """What the KV prefault keeps ahead of (engine/kv_prefault.py): never-used blocks go out
    lowest id first, and reused ones do not move the mark."""
    pool = BlockPool(6)
    assert pool.high_water == 0
    blocks = pool.allocate(2)
    assert pool.high_water == 2
    pool.free(reversed(blocks))
    pool.allocate(3)  # 2, 3, 4: never used before
    assert pool.high_water == 5
    pool.allocate(3)  # 5, then 1 and 0 again
    assert pool.high_water == 6
