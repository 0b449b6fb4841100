"""Greedy decoding matches transformers `generate` token for token (float32), with logprobs
within a small tolerance of its log_softmax: mixed batches, chunked prefill, prefix-cache
hits, preemption, for a tiny Llama (GQA), a tiny Qwen2 (qkv bias) and the real SmolLM2, whose
divergences must be near-ties within NEAR_TIE_NATS (engine_harness)."""

from __future__ import annotations

import pytest
from engine_harness import (
    NEAR_TIE_NATS,
    add_all,
    assert_greedy_parity,
    assert_logprobs_close,
    assert_no_leak,
    drive,
    hf_greedy,
    hf_prompt_logprobs,
    make_engine,
    random_prompts,
    smollm2_chat_prompts,
)

from engine.sampling_params import SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5)
# One prompt of each interesting shape: a single token, shorter than a block, several blocks
# with a partial tail, an exact multiple of the block size (4), and a long one.
LENGTHS = [1, 3, 17, 24, 45]


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model_dir(request, tiny_llama_dir, tiny_qwen2_dir):
    return {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[request.param]


def _prompts(seed: int = 0) -> dict[str, list[int]]:
    return {f"p{n}": prompt for n, prompt in zip(LENGTHS, random_prompts(LENGTHS, seed), strict=True)}


def _check_all(model_dir, prompts, results) -> None:
    assert set(results) == set(prompts)
    for rid, prompt in prompts.items():
        assert_greedy_parity(model_dir, prompt, results[rid], MAX_TOKENS)


def test_mixed_length_batch_matches_transformers(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    prompts = _prompts()
    add_all(engine, prompts, GREEDY)
    results = drive(engine)
    _check_all(tiny_model_dir, prompts, results)
    # All prompts were prefilled together in the first step, then decoded as one batch.
    assert engine.num_steps == MAX_TOKENS
    assert_no_leak(engine)


def test_chunked_prefill_mixed_with_decode_matches_transformers(tiny_model_dir):
    # Chunks of at most 5 tokens and 12 tokens a step: the long prompts are prefilled in
    # pieces while the short ones are already decoding in the same forward passes.
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=12, long_prefill_token_threshold=5)
    prompts = _prompts()
    add_all(engine, prompts, GREEDY)
    results = drive(engine)
    _check_all(tiny_model_dir, prompts, results)
    assert engine.num_steps > MAX_TOKENS + 45 // 12
    assert_no_leak(engine)


def test_prefix_cache_hits_in_a_second_round_match_transformers(tiny_model_dir):
    engine = make_engine(tiny_model_dir, long_prefill_token_threshold=7)
    first = _prompts()
    add_all(engine, first, GREEDY)
    first_results = drive(engine)
    _check_all(tiny_model_dir, first, first_results)
    assert engine.kv.prefix_hits == 0
    # Second round: a prompt again, new suffixes on an old prefix (at and off a block
    # boundary), and a prompt that extends an old prompt *and* part of its output.
    long_prompt = first["p45"]
    (suffix,) = random_prompts([6], seed=7)
    second = {
        "again": long_prompt,
        "branch": long_prompt[:20] + suffix,
        "mid-block": long_prompt[:18] + suffix,
        "extended": first["p24"] + first_results["p24"].token_ids[:12],
    }
    add_all(engine, second, GREEDY)
    results = drive(engine)
    _check_all(tiny_model_dir, second, results)
    # Hits are whole blocks of 4, and at least one prompt token is always computed.
    assert results["again"].num_cached_tokens == 44
    assert results["branch"].num_cached_tokens == 20
    assert results["mid-block"].num_cached_tokens == 16
    assert results["extended"].num_cached_tokens == 32
    assert_no_leak(engine)


def test_prompts_sharing_blocks_computed_in_their_own_step_match_transformers(tiny_model_dir):
    """Prompts sent together behind a prefix no block holds: the later ones take the first
    one's blocks in the same step (every layer writes the step's K/V before its attention
    reads the cache), with the same two prompts twice (n choices of one prompt), and each
    decodes as transformers does."""
    engine = make_engine(tiny_model_dir)
    (shared,) = random_prompts([22], seed=3)
    suffixes = random_prompts([3, 5], seed=4)
    prompts = {"first": shared + suffixes[0], "again": shared + suffixes[0],
               "other": shared + suffixes[1], "other-again": shared + suffixes[1]}
    add_all(engine, prompts, GREEDY)
    results = drive(engine)
    _check_all(tiny_model_dir, prompts, results)
    assert engine.num_steps == MAX_TOKENS  # all four prefilled in the first step
    assert results["first"].num_cached_tokens == 0
    assert results["again"].num_cached_tokens == 24  # whole blocks of 4 before the last token
    assert results["other"].num_cached_tokens == 20  # the shared prefix's whole blocks
    assert results["other-again"].num_cached_tokens == 24
    assert_no_leak(engine)


def test_preemption_under_a_tiny_cache_matches_transformers(tiny_model_dir):
    # 36 blocks of 4 tokens; the five requests need 7 + 7 + 11 + 12 + 18 = 55 blocks at the end.
    engine = make_engine(tiny_model_dir, num_kv_blocks=36, long_prefill_token_threshold=8)
    prompts = _prompts()
    add_all(engine, prompts, GREEDY)
    results = drive(engine)
    assert engine.scheduler.num_preemptions > 0
    _check_all(tiny_model_dir, prompts, results)
    assert_no_leak(engine)


def test_preemption_without_prefix_caching_matches_transformers(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=36, enable_prefix_caching=False)
    prompts = _prompts(seed=1)
    add_all(engine, prompts, GREEDY)
    results = drive(engine)
    assert engine.scheduler.num_preemptions > 0
    _check_all(tiny_llama_dir, prompts, results)
    assert_no_leak(engine)


def test_block_size_sixteen_matches_transformers(tiny_qwen2_dir):
    engine = make_engine(tiny_qwen2_dir, block_size=16, num_kv_blocks=64, long_prefill_token_threshold=10)
    prompts = _prompts(seed=2)
    add_all(engine, prompts, GREEDY)
    _check_all(tiny_qwen2_dir, prompts, drive(engine))
    assert_no_leak(engine)


def test_a_stop_token_ends_the_request_where_transformers_would(tiny_llama_dir):
    (prompt,) = random_prompts([9], seed=3)
    ref_tokens, _ = hf_greedy(str(tiny_llama_dir), tuple(prompt), MAX_TOKENS)
    stop = ref_tokens[10]
    cut = ref_tokens.index(stop) + 1  # generate(eos_token_id=stop) stops after its first one
    engine = make_engine(tiny_llama_dir)
    engine.add_request("r", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop_token_ids=(stop,)))
    ours = drive(engine)["r"]
    assert ours.token_ids == ref_tokens[:cut]
    assert ours.finish_reason == "stop"
    assert_no_leak(engine)


# -- prompt logprobs (echo) -------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [512, 7])
def test_prompt_logprobs_match_transformers_log_softmax(tiny_model_dir, chunk):
    engine = make_engine(tiny_model_dir, long_prefill_token_threshold=chunk)
    prompts = _prompts(seed=4)
    # Cache the prompts first: prompt logprobs must still score every position.
    add_all(engine, prompts, SamplingParams(max_tokens=1, temperature=0.0))
    drive(engine)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, logprobs=2)
    add_all(engine, {f"echo-{rid}": p for rid, p in prompts.items()}, params)
    results = drive(engine)
    for rid, prompt in prompts.items():
        ours = results[f"echo-{rid}"]
        assert ours.prompt_logprobs_deliveries == 1
        lps = ours.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        ref = hf_prompt_logprobs(str(tiny_model_dir), tuple(prompt))
        for pos in range(1, len(prompt)):
            assert_logprobs_close(lps[pos], ref[pos - 1], prompt[pos], 1e-4)
            assert len(lps[pos].top) == 3
            assert lps[pos].rank == int((ref[pos - 1] > ref[pos - 1][prompt[pos]]).sum()) + 1
        # The first generated token's logprob is scored from the last prompt position.
        assert_logprobs_close(ours.logprobs[0], ref[-1], ours.token_ids[0], 1e-4)
    assert_no_leak(engine)


def test_prompt_logprobs_are_delivered_once_even_after_preemption(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=30)
    prompts = _prompts(seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, prompt_logprobs=1, logprobs=5)
    add_all(engine, prompts, params)
    results = drive(engine)
    assert engine.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert results[rid].prompt_logprobs_deliveries == 1
        assert len(results[rid].prompt_logprobs) == len(prompt)
        assert_greedy_parity(tiny_llama_dir, prompt, results[rid], MAX_TOKENS)
    assert_no_leak(engine)


# -- the real model -----------------------------------------------------------------------------

SMOL_TOKENS = 32
# 30 layers of float32 summed in a different order than transformers: logprobs agree to ~1e-4.
SMOL_ATOL = 2e-3


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers_batched_chunked_preempted_and_cached(smollm2_dir):
    prompts = smollm2_chat_prompts(smollm2_dir)
    assert all(isinstance(t, int) for p in prompts.values() for t in p)
    params = SamplingParams(max_tokens=SMOL_TOKENS, temperature=0.0, logprobs=5)
    # Block size 16 as served; ~40-token prompts prefilled in chunks of 16; eight blocks
    # cannot hold the three sequences at full length, so the newest is preempted.
    engine = make_engine(smollm2_dir, block_size=16, num_kv_blocks=8, long_prefill_token_threshold=16)
    add_all(engine, prompts, params)
    first = drive(engine)
    assert engine.scheduler.num_preemptions > 0
    # Second round: the chat template's system prompt (and whatever survived eviction)
    # comes from the prefix cache.
    add_all(engine, {f"again-{rid}": p for rid, p in prompts.items()}, params)
    second = drive(engine)
    compared = 0
    for rid, prompt in prompts.items():
        for ours in (first[rid], second[f"again-{rid}"]):
            compared += assert_greedy_parity(
                smollm2_dir, prompt, ours, SMOL_TOKENS, real_model=True, atol=SMOL_ATOL
            )
        assert second[f"again-{rid}"].num_cached_tokens >= 16
    # Near-ties are rare: nearly everything was compared (one answer ends early at EOS).
    assert compared >= 2 * (len(prompts) - 1) * SMOL_TOKENS * 3 // 4
    assert_no_leak(engine)


def test_a_divergence_wider_than_the_near_tie_bound_fails_parity(tiny_llama_dir):
    """The rule itself: transformers' second choice in place of its first, each in the other's
    top 5, is a failure unless their logprobs differ by less than NEAR_TIE_NATS (float32)."""
    (prompt,) = random_prompts([9], seed=3)
    engine = make_engine(tiny_llama_dir)
    engine.add_request("r", prompt, GREEDY)
    ours = drive(engine)["r"]
    assert_greedy_parity(tiny_llama_dir, prompt, ours, MAX_TOKENS, real_model=True)
    _, ref_logprobs = hf_greedy(str(tiny_llama_dir), tuple(prompt), MAX_TOKENS)
    best, second = ref_logprobs[5].topk(2).indices.tolist()
    assert float(ref_logprobs[5][best] - ref_logprobs[5][second]) > NEAR_TIE_NATS
    ours.token_ids[5] = second
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_greedy_parity(tiny_llama_dir, prompt, ours, MAX_TOKENS, real_model=True)
