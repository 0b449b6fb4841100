"""The decode engine adopting prompt blocks reserved for KV still on its way
(engine/pending_prefixes.py): prompts sent together behind a new prefix get only their own
blocks' KV, start once the shared blocks' KV lands, and keep their first token when it never
does."""

from __future__ import annotations

import pytest
from engine_harness import assert_no_leak, drive, make_engine, random_prompts
from test_disaggregation import (
    BLOCK,
    GREEDY,
    blank_kv,
    prefill,
    shared_prompts,
    single_engine_tokens,
)

from engine.kv_cache_manager import cdiv
from engine.request import RequestStatus


@pytest.mark.parametrize("landing", ["first-prompt-first", "follower-first"])
def test_a_prefix_reserved_but_not_yet_received_is_adopted_not_shipped_again(tiny_llama_dir,
                                                                                landing):
    """Prompts sent together behind a new system prompt reach the decode engine before any
    of their KV: the second reservation adopts the first's three pending blocks, and only
    its own blocks' KV is shipped. It starts only once the first's KV is in (its own may land
    first: it waits). Tokens and logprobs equal one engine's."""
    prompts = shared_prompts(seed=30)
    expected = single_engine_tokens(tiny_llama_dir, prompts, GREEDY)
    prefill_engine = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    decode_engine = make_engine(tiny_llama_dir)
    held = {}
    for rid, prompt in prompts.items():
        reservation = decode_engine.remote.reserve(rid, prompt, GREEDY, reuse_cached_prefix=True)
        held[rid] = reservation.num_cached_tokens
    assert held == {"a": 0, "b": 12}
    payloads = {rid: prefill(prefill_engine, rid, prompt, GREEDY, kv_reused_tokens=held[rid])
                for rid, prompt in prompts.items()}
    assert payloads["b"][1].shape[2] == cdiv(len(prompts["b"]), BLOCK) - 3
    order = ["a", "b"] if landing == "first-prompt-first" else ["b", "a"]
    decode_engine.remote.receive(order[0], *payloads[order[0]])
    if landing == "follower-first":  # b waits for a's KV, holding its first token
        assert "b" in decode_engine.scheduler.waiting_for_kv
        assert not decode_engine.scheduler.running
    decode_engine.remote.receive(order[1], *payloads[order[1]])
    assert not decode_engine.scheduler.waiting_for_kv
    collected = drive(decode_engine)
    results = {rid: [payloads[rid][0], *collected[rid].token_ids] for rid in prompts}
    assert results == expected
    assert_no_leak(prefill_engine)
    assert_no_leak(decode_engine)


@pytest.mark.parametrize("fate", ["aborted", "recomputed"])
@pytest.mark.parametrize("own_kv", ["landed-before", "lands-after"])
def test_a_follower_whose_adopted_kv_never_lands_is_recomputed_keeping_its_first_token(
        tiny_llama_dir, fate, own_kv):
    """The blocks a follower adopted will never hold the first prompt's KV (it was aborted,
    or its transfer failed and it is recomputed here): the follower is prefilled here, once
    its own first token is in, and keeps that token, which the prefill worker answered and the
    gateway may have streamed already. Here that token is not the greedy one, so a follower
    that sampled its first token again would not continue it. Nothing leaks."""
    prompts = shared_prompts(seed=40)
    decode_engine = make_engine(tiny_llama_dir)
    greedy = single_engine_tokens(tiny_llama_dir, {"b": prompts["b"]}, GREEDY)["b"][0]
    forced = next(t for t in range(greedy + 1, greedy + 10)
                  if t not in decode_engine.model_config.eos_token_ids)
    expected = single_engine_tokens(tiny_llama_dir, {"a": prompts["a"],
                                                     "b": [*prompts["b"], forced]}, GREEDY)
    for rid, prompt in prompts.items():
        decode_engine.remote.reserve(rid, prompt, GREEDY, reuse_cached_prefix=True)
    b = decode_engine.scheduler.requests["b"]
    own_blocks = cdiv(len(prompts["b"]), BLOCK) - 3
    if own_kv == "landed-before":  # b's KV is in; it waits for a's
        assert decode_engine.remote.receive("b", forced, blank_kv(decode_engine, own_blocks)) is None
        assert "b" in decode_engine.scheduler.waiting_for_kv
    if fate == "aborted":
        assert decode_engine.abort("a") is True
    else:
        assert decode_engine.remote.recompute_locally("a") is True
    if own_kv == "lands-after":  # b waits for its own first token, then is recomputed
        assert "b" in decode_engine.scheduler.waiting_for_kv and b.kv_lost
        assert decode_engine.remote.receive("b", forced, blank_kv(decode_engine, own_blocks)) is None
    assert b.status == RequestStatus.WAITING and b.kv_reused_tokens == 0
    assert b.output_token_ids == [forced]
    collected = drive(decode_engine)
    assert collected["b"].token_ids == expected["b"][: GREEDY.max_tokens - 1]
    assert collected["b"].outputs[0].num_output_tokens == 2  # streamed from index 1 on
    if fate == "recomputed":
        assert collected["a"].token_ids == expected["a"]
    assert_no_leak(decode_engine)


def test_a_pending_block_is_adopted_only_with_the_same_tokens_and_salt(tiny_llama_dir):
    """Another tenant's salt, or a different prefix, adopts nothing of a pending reservation."""
    prompts = shared_prompts(seed=50)
    engine = make_engine(tiny_llama_dir)
    engine.remote.reserve("a", prompts["a"], GREEDY, reuse_cached_prefix=True)
    other_tenant = engine.remote.reserve("t", prompts["b"], GREEDY, cache_salt="tenant-2",
                                         reuse_cached_prefix=True)
    different = engine.remote.reserve("d", random_prompts([18], seed=51)[0], GREEDY,
                                      reuse_cached_prefix=True)
    assert other_tenant.num_cached_tokens == 0 and different.num_cached_tokens == 0
    for rid in ("a", "t", "d"):
        engine.abort(rid)
    assert_no_leak(engine)
