"""Prefix-cache block hashes (engine/block_pool.py): a BLAKE2b chain seeded by a per-tenant
salt. Equal hashes must mean equal salt and equal whole prefix; the exact block ids a
KVCacheManager hands out show that a salt partitions the cache."""

from __future__ import annotations

import pytest

from engine.block_pool import ROOT_HASH, hash_block_tokens, hash_prompt_blocks, root_hash
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

MERSENNE_61 = (1 << 61) - 1  # Python reduces int hashes modulo this


def test_parents_differing_by_2_61_minus_1_do_not_collide():
    # hash((parent, tokens)) hashed the parent int modulo 2^61-1, so two different prefixes
    # whose parent hashes differed by it gave the next block one hash: a hit on wrong KV
    # whenever that block's own tokens matched.
    tokens = (11, 12, 13, 14)
    for parent in (12345, ROOT_HASH % (1 << 64)):
        assert hash_block_tokens(parent, tokens) != hash_block_tokens(parent + MERSENNE_61, tokens)


def test_block_hash_is_a_16_byte_digest_of_parent_and_tokens():
    h = hash_block_tokens(ROOT_HASH, (1, 2, 3, 4))
    assert 0 <= h < 1 << 128 and h.bit_length() > 64
    assert h != hash_block_tokens(ROOT_HASH, (1, 2, 3, 5))
    assert h != hash_block_tokens(ROOT_HASH + 1, (1, 2, 3, 4))
    # Token ids are fixed-width: (1, 2) is not (1, 2, 0) or (258,) in some other encoding.
    assert len({hash_block_tokens(ROOT_HASH, t) for t in [(1, 2), (1, 2, 0), (258,), (2, 1)]}) == 4


def test_prompt_hashes_chain_block_by_block():
    prompt = list(range(100, 140))
    hashes = hash_prompt_blocks(prompt, 8, "tenant:a")
    assert len(hashes) == 5
    parent = root_hash("tenant:a")
    for i, h in enumerate(hashes):
        parent = hash_block_tokens(parent, tuple(prompt[i * 8 : (i + 1) * 8]))
        assert h == parent
    assert hash_prompt_blocks(prompt + [1, 2, 3], 8, "tenant:a") == hashes  # partial: no hash


def test_salts_give_disjoint_chains_and_no_salt_is_the_shared_root():
    prompt = list(range(64))
    a, b = hash_prompt_blocks(prompt, 16, "tenant:a"), hash_prompt_blocks(prompt, 16, "tenant:b")
    assert not set(a) & set(b)
    assert hash_prompt_blocks(prompt, 16) == hash_prompt_blocks(prompt, 16, "")
    assert root_hash("") == ROOT_HASH != root_hash("tenant:a")
    assert root_hash("group:x") != root_hash("tenant:x")


@pytest.mark.parametrize("tokens", [[-1, 2], [1 << 32, 2], ["a", 2], [1.5, 2]])
def test_token_ids_outside_uint32_are_a_value_error(tokens):
    with pytest.raises(ValueError, match="token ids"):
        hash_prompt_blocks(tokens, 2)


def test_an_oversized_salt_is_a_value_error_when_the_request_is_made():
    with pytest.raises(ValueError, match="cache salt"):
        Request("r", [1, 2, 3], SamplingParams(), cache_salt="x" * 257)
    Request("r", [1, 2, 3], SamplingParams(), cache_salt="x" * 256)


def _request(rid: str, prompt: list[int], salt: str) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=4), cache_salt=salt)


def _run_prompt(kv: KVCacheManager, request: Request) -> list[int]:
    """Admit the request as the scheduler would, compute its prompt, cache its blocks."""
    hits, num_hit = kv.get_computed_blocks(request)
    request.num_cached_tokens = num_hit
    new_ids = kv.allocate_slots(request, request.num_tokens - num_hit, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return [b.block_id for b in hits] + new_ids


def test_a_tenant_hits_only_blocks_cached_under_its_own_salt():
    kv = KVCacheManager(num_blocks=11, block_size=4)
    prompt = list(range(1, 14))  # 3 full blocks and 1 token

    def run(rid: str, salt: str) -> tuple[list[int], int]:
        request = _request(rid, prompt, salt)
        block_ids = _run_prompt(kv, request)
        kv.free(request)
        return block_ids, request.num_cached_tokens

    assert run("a1", "tenant:a") == ([0, 1, 2, 3], 0)
    assert run("b1", "tenant:b") == ([4, 5, 6, 7], 0)  # nothing of tenant a's reused
    assert run("a2", "tenant:a") == ([0, 1, 2, 8], 12)  # its own three blocks
    assert run("g1", "group:common") == ([9, 10, 3, 7], 0)
    assert run("g2", "group:common") == ([9, 10, 3, 6], 12)  # a shared group shares
    assert kv.num_free_blocks == 11
