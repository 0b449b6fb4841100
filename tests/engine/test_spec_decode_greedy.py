"""Greedy decoding gives the same tokens (and logprobs) with and without speculation: scripted
proposals right and wrong across block boundaries, stop tokens and max_tokens inside an
accepted run, the n-gram proposer, a draft model equal to the target (everything accepted) and
one unrelated to it (almost nothing accepted), and SmolLM2 copying a text."""

from __future__ import annotations

import dataclasses

import pytest
from engine_harness import (
    Collected,
    add_all,
    assert_greedy_parity,
    assert_no_leak,
    drive,
    make_engine,
    random_prompts,
)
from spec_decode_harness import (
    ScriptedProposer,
    draft_pool_is_free,
    drive_checked,
    spec_engine,
)

from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3, ignore_eos=True)
# Prompt lengths around the block size (4) so verified runs start at every offset in a block.
LENGTHS = [1, 3, 4, 9, 18]


def _prompts(seed: int = 20) -> dict[str, list[int]]:
    return {f"p{n}": p for n, p in zip(LENGTHS, random_prompts(LENGTHS, seed), strict=True)}


def _reference(model_dir, prompts, params=GREEDY) -> dict[str, Collected]:
    engine = make_engine(model_dir)
    add_all(engine, prompts, params)
    return drive(engine)


def _assert_same(reference: dict[str, Collected], results: dict[str, Collected]) -> None:
    assert set(results) == set(reference)
    for rid, ref in reference.items():
        ours = results[rid]
        assert ours.token_ids == ref.token_ids, rid
        assert ours.finish_reason == ref.finish_reason, rid
        assert len(ours.logprobs) == len(ref.logprobs)
        for mine, theirs in zip(ours.logprobs, ref.logprobs, strict=True):
            _assert_logprobs_match(mine, theirs, atol=1e-4)


def _assert_logprobs_match(mine, theirs, atol: float) -> None:
    """Same rank and top alternatives, values within atol (verification scores a position in
    a multi-token forward, plain decoding in a one-token one: summation order differs)."""
    assert mine.rank == theirs.rank
    assert abs(mine.logprob - theirs.logprob) <= atol
    for token, value in mine.top.items():
        if token in theirs.top:
            assert abs(value - theirs.top[token]) <= atol
    assert len(set(mine.top) ^ set(theirs.top)) <= 2  # only a float tie at the n-th may swap


WRONG_PATTERNS = {
    "all_right": lambda rid, i: False,
    "all_wrong": lambda rid, i: True,
    "every_third_wrong": lambda rid, i: i % 3 == 0,
    "wrong_by_request": lambda rid, i: rid in ("p3", "p18") and i % 5 == 2,
}


# "auto": verification rows go through the C++ decode kernel, one row per position, each at
# its own context length; "torch": through the causal prefill path. Both must keep the text.
@pytest.mark.parametrize("cpu_attention", ["auto", "torch"])
@pytest.mark.parametrize("pattern", sorted(WRONG_PATTERNS))
def test_scripted_proposals_keep_the_greedy_output(tiny_llama_dir, pattern, cpu_attention):
    prompts = _prompts()
    reference = _reference(tiny_llama_dir, prompts)
    engine = spec_engine(tiny_llama_dir, k=5, cpu_attention=cpu_attention)
    engine.speculator.proposer = ScriptedProposer(
        {rid: c.token_ids for rid, c in reference.items()}, WRONG_PATTERNS[pattern],
        vocab=engine.model_config.vocab_size,
    )
    add_all(engine, prompts, GREEDY)
    results = drive_checked(engine)
    _assert_same(reference, results)
    for rid, prompt in prompts.items():
        assert_greedy_parity(tiny_llama_dir, prompt, results[rid], MAX_TOKENS)
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] > 0
    if pattern == "all_right":
        # Every step after the first verifies up to 5 tokens and keeps them all, plus one.
        assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"]
        assert engine.num_steps == 1 + -(-(MAX_TOKENS - 1) // 6)
    elif pattern == "all_wrong":
        assert stats["spec_accepted_tokens"] == 0
        assert engine.num_steps == MAX_TOKENS
    else:
        assert 0 < stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert_no_leak(engine)


def test_stop_token_inside_an_accepted_run_ends_the_request_there(tiny_llama_dir):
    prompts = _prompts(seed=21)
    reference = _reference(tiny_llama_dir, prompts)
    # The first token is the prefill's; verified runs of 5 then cover outputs 1-5, 6-10, ...
    # Stop each request on a token first seen in the middle of a run.
    stops = {}
    for rid, ref in reference.items():
        index = next(i for i in range(7, 20) if i % 5 != 0 and ref.token_ids[i] not in ref.token_ids[:i])
        stops[rid] = index
    engine = spec_engine(tiny_llama_dir, k=4)
    engine.speculator.proposer = ScriptedProposer(
        {rid: c.token_ids for rid, c in reference.items()}, lambda rid, i: False,
        vocab=engine.model_config.vocab_size,
    )
    for rid, prompt in prompts.items():
        stop = reference[rid].token_ids[stops[rid]]
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3,
                                ignore_eos=True, stop_token_ids=(stop,))
        engine.add_request(rid, prompt, params)
    results = drive_checked(engine)
    for rid, index in stops.items():
        assert results[rid].token_ids == reference[rid].token_ids[: index + 1], rid
        assert len(results[rid].logprobs) == index + 1
        assert results[rid].finish_reason == "stop"
        assert results[rid].outputs[-1].num_output_tokens == index + 1
    assert engine.stats()["spec_accepted_tokens"] == engine.stats()["spec_proposed_tokens"]
    assert_no_leak(engine)


def test_max_tokens_inside_a_run_ends_with_exactly_max_tokens(tiny_llama_dir):
    prompts = _prompts(seed=22)
    reference = _reference(tiny_llama_dir, prompts)
    engine = spec_engine(tiny_llama_dir, k=4)
    engine.speculator.proposer = ScriptedProposer(
        {rid: c.token_ids for rid, c in reference.items()}, lambda rid, i: False,
        vocab=engine.model_config.vocab_size,
    )
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 3, 7, 8, 13)]
    for (rid, prompt), p in zip(prompts.items(), params, strict=True):
        engine.add_request(rid, prompt, p)
    results = drive_checked(engine)
    for (rid, _), p in zip(prompts.items(), params, strict=True):
        assert results[rid].token_ids == reference[rid].token_ids[: p.max_tokens]
        assert results[rid].finish_reason == "length"
    assert_no_leak(engine)


def test_ngram_proposer_keeps_the_greedy_output(tiny_llama_dir):
    # A random model rarely repeats itself, so with one-token matches most proposals fail:
    # this is the many-rejections path, end to end.
    prompts = {rid: p + p[:3] + p for rid, p in _prompts(seed=23).items()}
    reference = _reference(tiny_llama_dir, prompts)
    engine = spec_engine(tiny_llama_dir, k=3, ngram_min=1)
    add_all(engine, prompts, GREEDY)
    results = drive_checked(engine)
    _assert_same(reference, results)
    assert engine.stats()["spec_proposed_tokens"] > 20
    assert_no_leak(engine)


def test_draft_equal_to_the_target_is_always_accepted(tiny_llama_dir):
    prompts = _prompts(seed=24)
    reference = _reference(tiny_llama_dir, prompts)
    engine = spec_engine(tiny_llama_dir, method="draft", k=3, draft=tiny_llama_dir)
    add_all(engine, prompts, GREEDY)
    results = drive_checked(engine)
    _assert_same(reference, results)
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] == stats["spec_proposed_tokens"] > 0
    assert engine.num_steps == 1 + -(-(MAX_TOKENS - 1) // 4)
    assert_no_leak(engine)
    assert draft_pool_is_free(engine)


def test_unrelated_draft_model_keeps_the_greedy_output(tiny_llama_dir, tiny_draft_dir):
    prompts = _prompts(seed=25)
    reference = _reference(tiny_llama_dir, prompts)
    engine = spec_engine(tiny_llama_dir, method="draft", k=3, draft=tiny_draft_dir,
                         max_num_batched_tokens=16, long_prefill_token_threshold=5)
    add_all(engine, prompts, GREEDY)
    results = drive_checked(engine)
    _assert_same(reference, results)
    stats = engine.stats()
    assert stats["spec_proposed_tokens"] > 50
    assert stats["spec_accepted_tokens"] < stats["spec_proposed_tokens"]
    assert_no_leak(engine)
    assert draft_pool_is_free(engine)


def test_requests_that_opt_out_are_not_speculated(tiny_llama_dir):
    prompts = _prompts(seed=26)
    engine = spec_engine(tiny_llama_dir, method="draft", k=3, draft=tiny_llama_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                            disable_speculation=True)
    add_all(engine, prompts, params)
    results = drive_checked(engine)
    assert engine.stats()["spec_proposed_tokens"] == 0
    assert engine.num_steps == MAX_TOKENS
    reference = _reference(tiny_llama_dir, prompts, params)
    assert {r: c.token_ids for r, c in results.items()} == {r: c.token_ids for r, c in reference.items()}


# -- SmolLM2 ------------------------------------------------------------------------------------

COPY_TEXT = (
    "The river keeps its song through the winter. Every morning the engineer reads the news, "
    "writes a long letter to her sister, and carries three red apples to the old library "
    "near the station."
)


@pytest.mark.slow
def test_smollm2_copying_a_text_gives_the_same_greedy_output_with_ngram(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    chats = {
        "copy": f"Repeat this text exactly, word for word:\n\n{COPY_TEXT}",
        "chat": "Give me three tips for a good night's sleep.",
    }
    prompts = {
        rid: tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
        for rid, text in chats.items()
    }
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=5)
    reference = _reference(smollm2_dir, prompts, params)
    engine = spec_engine(smollm2_dir, k=4, block_size=16, num_kv_blocks=64)
    add_all(engine, prompts, params)
    results = drive_checked(engine)
    for rid in prompts:
        _assert_same_or_near_tie(reference[rid], results[rid])
    stats = engine.stats()
    # Copying is what n-gram speculation is for: most proposals are kept.
    assert stats["spec_accepted_tokens"] > 0.5 * stats["spec_proposed_tokens"] > 10
    # Again with a stop token that came in the middle of a verified run: the request ends
    # on it, and the accepted tokens after it never reach the caller.
    copy = results["copy"]
    index = _inside_a_run(copy)
    stop = copy.token_ids[index]
    engine.add_request("copy-stop", prompts["copy"], dataclasses.replace(
        params, stop_token_ids=(stop,)))
    stopped = drive_checked(engine)["copy-stop"]
    assert stopped.token_ids == copy.token_ids[: index + 1]
    assert stopped.finish_reason == "stop"
    assert_no_leak(engine)


@pytest.mark.slow
def test_smollm2_with_a_draft_model_gives_the_same_greedy_output(smollm2_dir):
    """The draft path on a real model: SmolLM2 drafting for itself accepts its proposals
    (all but float near-ties), so whole verified runs cross 16-token blocks, and a stop token
    inside one ends the request on it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{COPY_TEXT}"}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    params = SamplingParams(max_tokens=40, temperature=0.0, logprobs=5)
    reference = _reference(smollm2_dir, {"copy": prompt}, params)["copy"]
    engine = spec_engine(smollm2_dir, method="draft", k=4, draft=smollm2_dir, block_size=16,
                         num_kv_blocks=32)
    engine.add_request("copy", prompt, params)
    ours = drive_checked(engine)["copy"]
    _assert_same_or_near_tie(reference, ours)
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0.9 * stats["spec_proposed_tokens"] > 20
    index = _inside_a_run(ours)
    engine.add_request("copy-stop", prompt, dataclasses.replace(
        params, stop_token_ids=(ours.token_ids[index],)))
    stopped = drive_checked(engine)["copy-stop"]
    assert stopped.token_ids == ours.token_ids[: index + 1]
    assert stopped.finish_reason == "stop"
    assert_no_leak(engine)
    assert draft_pool_is_free(engine)


def _inside_a_run(result: Collected) -> int:
    """Output index of a token that first appears inside (not at the end of) a step's delta
    of three or more tokens."""
    start = 0
    for out in result.outputs:
        n = len(out.new_token_ids)
        for i in range(start + 1, start + n - 1):
            if n >= 3 and result.token_ids[i] not in result.token_ids[:i]:
                return i
        start += n
    raise AssertionError("no verified run of three tokens with a new token inside it")


def _assert_same_or_near_tie(ref: Collected, ours: Collected) -> None:
    """Equal tokens, or a divergence at a genuine near-tie (DESIGN.md), compared up to it."""
    for i, (a, b) in enumerate(zip(ours.token_ids, ref.token_ids, strict=False)):
        if a != b:
            assert a in ref.logprobs[i].top and b in ours.logprobs[i].top, (i, a, b)
            return
        _assert_logprobs_match(ours.logprobs[i], ref.logprobs[i], atol=1e-3)
    assert ours.token_ids == ref.token_ids
