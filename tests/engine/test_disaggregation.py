"""The prefill/decode role hooks of LLMEngine: a prefill engine returns the prompt's KV with
the first token and frees its blocks; a decode engine reserves blocks, receives that KV and
continues exactly as one engine would have."""

from __future__ import annotations

import pytest
import torch
from engine_harness import assert_no_leak, drive, make_engine, random_prompts

from engine.kv_cache_manager import cdiv
from engine.remote_prefill import KVCacheFull
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2)
SEEDED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=40, seed=1234)


def prefill(engine, rid, prompt, params, kv_reused_tokens=0):
    """Prefill role: returns (first token, KV payload); checks the output that carries them.
    `kv_reused_tokens`: the decode engine holds that much of the prompt, so it is not sent."""
    engine.add_request(rid, prompt, params, hold_kv=True, kv_reused_tokens=kv_reused_tokens)
    outputs = [out for _ in range(100) if engine.has_unfinished() for out in engine.step()]
    (out,) = [o for o in outputs if o.request_id == rid]
    assert out.finished and len(out.new_token_ids) == 1
    assert out.kv is not None
    return out.new_token_ids[0], out.kv


def blank_kv(engine, num_blocks):
    """A payload of the right layout for `num_blocks` blocks (its values do not matter here)."""
    return torch.zeros_like(engine.runner.kv_cache[:, :, :num_blocks])


def shared_prompts(seed: int) -> dict[str, list[int]]:
    """Two prompts sharing 3 full blocks (12 tokens), each with its own tail."""
    shared = random_prompts([12], seed=seed)[0]
    return {"a": shared + random_prompts([5], seed=seed + 1)[0],
            "b": shared + random_prompts([6], seed=seed + 2)[0]}


def single_engine_tokens(model_dir, prompts, params):
    engine = make_engine(model_dir)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    return {rid: r.token_ids for rid, r in drive(engine).items()}


def test_hold_kv_returns_the_prompt_kv_with_the_first_token_and_frees_the_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    (prompt,) = random_prompts([10], seed=0)
    # max_tokens > 1: the prefill role still stops after the first token.
    engine.add_request("r", prompt, GREEDY, hold_kv=True)
    (out,) = engine.step()
    assert out.finished and out.finish_reason is None  # the request goes on elsewhere
    first, kv = out.new_token_ids[0], out.kv
    config = engine.model_config
    assert kv.shape == (config.num_layers, 2, cdiv(10, BLOCK), BLOCK, config.num_kv_heads, config.head_dim)
    # The payload is a copy: what was in the request's blocks (0, 1, 2) when it finished.
    assert torch.equal(kv, engine.runner.kv_cache[:, :, :3])
    assert_no_leak(engine)
    # And the first token is the one a plain (non-held) request samples.
    assert first == single_engine_tokens(tiny_llama_dir, {"r": prompt}, GREEDY)["r"][0]


def test_hold_kv_payload_matches_a_fresh_prefill_of_the_same_prompt(tiny_llama_dir):
    # KV of the prompt only: positions 10 and 11 of block 2 are not part of it.
    (prompt,) = random_prompts([10], seed=0)
    a, b = make_engine(tiny_llama_dir), make_engine(tiny_llama_dir)
    _, kv_a = prefill(a, "r", prompt, GREEDY)
    b.add_request("other", random_prompts([7], seed=9)[0], GREEDY)  # shift b's block ids
    b.step()
    _, kv_b = prefill(b, "r", prompt, GREEDY)
    torch.testing.assert_close(kv_a[:, :, :2], kv_b[:, :, :2])
    torch.testing.assert_close(kv_a[:, :, 2, :2], kv_b[:, :, 2, :2])


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefill_on_one_engine_and_decode_on_another_equals_one_engine(tiny_llama_dir, params):
    prompts = dict(zip(["a", "b", "c"], random_prompts([5, 13, 22], seed=1), strict=True))
    expected = single_engine_tokens(tiny_llama_dir, prompts, params)

    prefill_engine = make_engine(tiny_llama_dir, long_prefill_token_threshold=6)
    decode_engine = make_engine(tiny_llama_dir)
    # The decode engine is busy with something else, so its block ids differ from prefill's.
    decode_engine.add_request("busy", random_prompts([9], seed=2)[0], GREEDY)
    decode_engine.step()
    results = {}
    for rid, prompt in prompts.items():
        reservation = decode_engine.remote.reserve(rid, prompt, params)
        assert len(reservation.block_ids) == cdiv(len(prompt), BLOCK)
        assert reservation.num_cached_tokens == 0
        first, kv = prefill(prefill_engine, rid, prompt, params)
        assert decode_engine.remote.receive(rid, first, kv) is None  # not finished yet
        results[rid] = [first]
        # Interleave: decode steps run while other requests are still being prefilled.
        for out in decode_engine.step():
            if out.request_id in results:
                results[out.request_id].extend(out.new_token_ids)
    collected = drive(decode_engine)
    for rid in prompts:
        results[rid].extend(collected[rid].token_ids)
    assert results == expected
    assert_no_leak(prefill_engine)
    assert_no_leak(decode_engine)


def test_prefill_from_the_prefix_cache_ships_the_whole_prompt_kv(tiny_llama_dir):
    (prompt,) = random_prompts([14], seed=3)
    expected = single_engine_tokens(tiny_llama_dir, {"r": prompt}, GREEDY)["r"]
    prefill_engine = make_engine(tiny_llama_dir)
    prefill(prefill_engine, "warm", prompt, GREEDY)
    decode_engine = make_engine(tiny_llama_dir)
    decode_engine.remote.reserve("r", prompt, GREEDY)
    first, kv = prefill(prefill_engine, "r", prompt, GREEDY)
    assert prefill_engine.kv.prefix_hits == 12  # three of its four blocks came from the cache
    decode_engine.remote.receive("r", first, kv)
    assert [first] + drive(decode_engine)["r"].token_ids == expected
    assert_no_leak(decode_engine)


def test_first_token_that_finishes_the_request_is_reported_by_remote_receive(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([6], seed=4)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.remote.reserve("r", prompt, params)
    out = engine.remote.receive("r", 42, blank_kv(engine, 2))
    assert out is not None and out.finished and out.finish_reason == "length"
    assert out.num_output_tokens == 1
    assert_no_leak(engine)


def test_eos_as_first_token_finishes_with_stop(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([6], seed=4)
    engine.remote.reserve("r", prompt, GREEDY)
    eos = engine.model_config.eos_token_ids[0]
    out = engine.remote.receive("r", eos, blank_kv(engine, 2))
    assert out is not None and out.finish_reason == "stop"
    assert_no_leak(engine)


def test_remote_reserve_raises_kv_cache_full_and_changes_nothing(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=6)
    a, b = random_prompts([16, 12], seed=5)
    assert engine.remote.reserve("a", a, GREEDY).block_ids == [0, 1, 2, 3]
    with pytest.raises(KVCacheFull, match="3 KV blocks needed, 2 free"):
        engine.remote.reserve("b", b, GREEDY)
    assert engine.kv.num_free_blocks == 2
    assert "b" not in engine.scheduler.requests
    engine.abort("a")
    # Retryable: the same id is accepted once there is room.
    # Free queue: never-used 4, 5, then a's blocks tail first.
    assert engine.remote.reserve("b", b, GREEDY).block_ids == [4, 5, 3]
    engine.abort("b")
    assert_no_leak(engine)


def test_abort_while_waiting_for_kv_frees_the_blocks_and_drops_late_kv(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([10], seed=6)
    engine.remote.reserve("r", prompt, GREEDY)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks - 3
    assert engine.abort("r") is True
    assert_no_leak(engine)
    kv = torch.ones(2, 2, 3, BLOCK, 4, 8)
    assert engine.remote.receive("r", 7, kv) is None
    assert not engine.runner.kv_cache.any(), "late KV of an aborted request was written"
    assert engine.abort("r") is False
    assert_no_leak(engine)


def test_recompute_locally_after_a_failed_transfer_gives_the_same_output(tiny_llama_dir):
    prompts = dict(zip(["a", "b"], random_prompts([7, 11], seed=7), strict=True))
    expected = single_engine_tokens(tiny_llama_dir, prompts, SEEDED)
    engine = make_engine(tiny_llama_dir)
    for rid, prompt in prompts.items():
        engine.remote.reserve(rid, prompt, SEEDED)
    assert engine.remote.recompute_locally("a") is True
    assert engine.remote.recompute_locally("a") is False  # no longer waiting for KV
    assert engine.remote.recompute_locally("ghost") is False
    assert engine.scheduler.requests["a"].status == RequestStatus.WAITING
    results = {}
    for _ in range(50):
        for out in engine.step():
            results.setdefault(out.request_id, []).extend(out.new_token_ids)
        if engine.scheduler.num_unfinished == 1:
            break
    assert results["a"] == expected["a"]
    assert "b" in engine.scheduler.waiting_for_kv  # untouched all along
    engine.abort("b")
    assert_no_leak(engine)


def test_abort_of_a_held_prefill_request_frees_its_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, long_prefill_token_threshold=4)
    (prompt,) = random_prompts([12], seed=8)
    engine.add_request("r", prompt, GREEDY, hold_kv=True)
    engine.step()  # first chunk only
    assert engine.abort("r") is True
    assert engine.step() == []
    assert_no_leak(engine)


def test_remote_receive_without_a_payload_is_refused_and_changes_nothing(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([10], seed=9)
    engine.remote.reserve("r", prompt, GREEDY)
    with pytest.raises(ValueError, match=r"got no KV payload.*start_for_profiling"):
        engine.remote.receive("r", 7, None)
    # Still waiting for its KV, nothing marked computed, nothing in the prefix cache.
    assert "r" in engine.scheduler.waiting_for_kv and engine.scheduler.running == []
    assert engine.scheduler.requests["r"].num_computed_tokens == 0
    assert engine.kv.pool.num_cached_blocks == 0
    # The real KV, when it comes, is taken as usual.
    first, kv = prefill(make_engine(tiny_llama_dir), "r", prompt, GREEDY)
    assert engine.remote.receive("r", first, kv) is None
    expected = single_engine_tokens(tiny_llama_dir, {"r": prompt}, GREEDY)["r"]
    assert [first] + drive(engine)["r"].token_ids == expected
    assert_no_leak(engine)


@pytest.mark.parametrize("num_blocks", [2, 4], ids=["fewer blocks", "more blocks"])
def test_a_payload_of_the_wrong_block_count_is_refused_and_changes_nothing(tiny_llama_dir, num_blocks):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([10], seed=10)  # three blocks reserved
    engine.remote.reserve("r", prompt, GREEDY)
    with pytest.raises(ValueError, match=r"expected 6 dims with 3 blocks on axis 2"):
        engine.remote.receive("r", 7, torch.ones_like(engine.runner.kv_cache[:, :, :num_blocks]))
    assert "r" in engine.scheduler.waiting_for_kv and engine.kv.pool.num_cached_blocks == 0
    assert not engine.runner.kv_cache.any(), "a refused payload was written"
    engine.abort("r")
    assert_no_leak(engine)


def test_the_profiler_entry_point_decodes_without_kv_and_caches_none_of_it(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([13], seed=11)  # three full blocks
    engine.remote.reserve("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert engine.remote.start_for_profiling("r", 100) is None
    assert engine.scheduler.requests["r"] in engine.scheduler.running
    collected = drive(engine)["r"]
    assert len(collected.token_ids) == 7 and collected.finish_reason == "length"
    # Blocks that never held the request's KV (nor KV computed from them) are not findable.
    assert engine.kv.pool.num_cached_blocks == 0
    assert engine.remote.start_for_profiling("ghost", 100) is None
    assert_no_leak(engine)


# -- the decode worker's cached prefix is reused, and only the KV after it travels -----------


def hold(engine, prompt):
    """Leave `prompt`'s full blocks in the decode engine's prefix cache: a request whose
    (blank) KV arrived from a prefill worker and that ran to its end."""
    engine.remote.reserve("warm", prompt, GREEDY)
    engine.remote.receive("warm", 7, blank_kv(engine, cdiv(len(prompt), BLOCK)))
    drive(engine)


def test_a_prefix_the_decode_engine_holds_is_reused_and_only_the_rest_is_shipped(tiny_llama_dir):
    """Two prompts share 3 blocks. The first one's KV arrives whole and is cached on the decode
    engine; the second reserves only its own blocks, and the prefill engine ships just those.
    Tokens and logprobs equal one engine's, and usage does not count the reused tokens as
    cached (the prefill engine computed them)."""
    prompts = shared_prompts(seed=20)
    expected = single_engine_tokens(tiny_llama_dir, prompts, GREEDY)
    prefill_engine = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    decode_engine = make_engine(tiny_llama_dir)
    results = {}
    for rid, prompt in prompts.items():
        reservation = decode_engine.remote.reserve(rid, prompt, GREEDY, reuse_cached_prefix=True)
        held = 0 if rid == "a" else 12
        assert reservation.num_cached_tokens == held
        assert len(reservation.block_ids) == cdiv(len(prompt), BLOCK) - held // BLOCK
        first, kv = prefill(prefill_engine, rid, prompt, GREEDY, kv_reused_tokens=held)
        assert kv.shape[2] == len(reservation.block_ids)
        decode_engine.remote.receive(rid, first, kv)
        collected = drive(decode_engine)[rid]
        results[rid] = [first, *collected.token_ids]
        assert collected.num_cached_tokens == 0
    assert results == expected
    assert decode_engine.kv.prefix_hits == 12
    assert_no_leak(prefill_engine)
    assert_no_leak(decode_engine)


def test_reserve_without_reuse_takes_every_block_fresh(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([10], seed=23)
    hold(engine, prompt)
    assert engine.kv.pool.num_cached_blocks >= 2  # the prompt's two full blocks, and outputs'
    # The same prompt again, reuse not asked (an older gateway): all three blocks are new.
    reservation = engine.remote.reserve("r", prompt, GREEDY)
    assert reservation.num_cached_tokens == 0 and len(reservation.block_ids) == 3
    engine.abort("r")
    assert_no_leak(engine)


def test_the_whole_prompt_is_never_reused(tiny_llama_dir):
    # A prompt of exactly two cached blocks: the last block still comes from the prefill
    # worker, which must produce the first token's logits from it.
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([8], seed=24)
    hold(engine, prompt + [1, 2])
    reservation = engine.remote.reserve("r", prompt, GREEDY, reuse_cached_prefix=True)
    assert reservation.num_cached_tokens == 4 and len(reservation.block_ids) == 1
    engine.abort("r")
    assert_no_leak(engine)


def test_a_payload_for_the_whole_prompt_is_refused_after_reuse(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([10], seed=25)
    hold(engine, prompt)
    engine.remote.reserve("r", prompt, GREEDY, reuse_cached_prefix=True)
    with pytest.raises(ValueError, match=r"expected 6 dims with 1 blocks on axis 2"):
        engine.remote.receive("r", 7, blank_kv(engine, 3))
    assert "r" in engine.scheduler.waiting_for_kv
    engine.abort("r")
    assert_no_leak(engine)


def test_recompute_locally_after_reuse_gives_the_same_output(tiny_llama_dir):
    shared = random_prompts([8], seed=26)[0]
    a, b = shared + [3, 4, 5], shared + [6, 7]
    expected = single_engine_tokens(tiny_llama_dir, {"b": b}, SEEDED)["b"]
    engine = make_engine(tiny_llama_dir)
    first, kv = prefill(make_engine(tiny_llama_dir), "a", a, GREEDY)
    engine.remote.reserve("a", a, GREEDY)
    engine.remote.receive("a", first, kv)
    drive(engine)
    assert engine.remote.reserve("b", b, SEEDED, reuse_cached_prefix=True).num_cached_tokens == 8
    assert engine.remote.recompute_locally("b") is True
    assert engine.scheduler.requests["b"].kv_reused_tokens == 0
    assert drive(engine)["b"].token_ids == expected
    assert_no_leak(engine)


@pytest.mark.parametrize("reused", [-4, 3, 12, 16], ids=["negative", "not whole blocks",
                                                          "the whole prompt", "past it"])
def test_held_kv_skip_that_is_not_whole_blocks_before_the_end_is_refused(tiny_llama_dir, reused):
    engine = make_engine(tiny_llama_dir)
    (prompt,) = random_prompts([12], seed=27)
    with pytest.raises(ValueError, match="multiple of the block size"):
        engine.add_request("r", prompt, GREEDY, hold_kv=True, kv_reused_tokens=reused)
    with pytest.raises(ValueError, match="held KV only"):
        engine.add_request("r", prompt, GREEDY, kv_reused_tokens=4)
    assert engine.scheduler.num_unfinished == 0
    assert_no_leak(engine)


def test_released_kv_is_refilled_by_the_next_prompt_and_unreleased_kv_is_left_alone(
        tiny_llama_dir):
    """A prefill worker hands a prompt's KV back once its transfer is done (release_kv); the
    next prompt's KV is gathered into that buffer. KV never handed back stays its owner's."""
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    prompts = random_prompts([10, 10, 10], seed=5)
    _, first = prefill(engine, "first", prompts[0], GREEDY)
    kept = first.clone()
    engine.release_kv(first)
    _, second = prefill(engine, "second", prompts[1], GREEDY)
    assert second.data_ptr() == first.data_ptr()  # the same memory, refilled
    assert not torch.equal(second, kept)  # with the second prompt's KV

    _, third = prefill(engine, "third", prompts[2], GREEDY)  # `second` is still out
    assert third.data_ptr() != second.data_ptr()
    again = make_engine(tiny_llama_dir, enable_prefix_caching=False)
    for rid, prompt, kv in (("second", prompts[1], second), ("third", prompts[2], third)):
        assert torch.equal(kv, prefill(again, rid, prompt, GREEDY)[1])  # nothing overwritten
