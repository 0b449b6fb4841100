"""LLMEngine admission and cancellation: bad input is a ValueError a user can act on, raised
before any state changes; aborts free every block; unknown or finished aborts are no-ops."""

from __future__ import annotations

import math

import pytest
from engine_harness import assert_no_leak, drive, make_engine, random_prompts

from engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 32


@pytest.fixture
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)


def _state(engine):
    """Everything a rejected request must leave untouched."""
    pool = engine.kv.pool
    return (
        dict(engine.scheduler.requests), list(engine.scheduler.waiting),
        dict(engine.scheduler.waiting_for_kv), dict(engine._held),
        list(pool._free), engine._rng.getstate(), engine.kv.prefix_queries,
    )


GOOD = [5, 6, 7]
BAD_INPUTS = {
    "prompt longer than the context": (
        list(range(3, 3 + MAX_MODEL_LEN)), SamplingParams(),
        r"the prompt has 32 tokens but the model's context is 32 tokens .*shorten the prompt",
    ),
    "empty prompt": ([], SamplingParams(), r"the prompt is empty; send at least one token"),
    "token outside the vocabulary": (
        [5, 768], SamplingParams(), r"prompt token id 768 is outside the vocabulary \[0, 768\)"
    ),
    "negative token": ([-1], SamplingParams(), r"prompt token id -1 is outside the vocabulary"),
    "max_tokens 0": (GOOD, SamplingParams(max_tokens=0), r"max_tokens must be an integer >= 1"),
    "NaN temperature": (GOOD, SamplingParams(temperature=math.nan), r"temperature must be a finite number"),
    "negative temperature": (GOOD, SamplingParams(temperature=-1.0), r"temperature must be in \[0, 2\]"),
    "temperature above 2": (GOOD, SamplingParams(temperature=2.5), r"temperature must be in \[0, 2\]"),
    "top_p 0": (GOOD, SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
    "top_p above 1": (GOOD, SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    "max_tokens beyond the context": (
        GOOD, SamplingParams(max_tokens=MAX_MODEL_LEN + 1),
        r"max_tokens=33 exceeds the model's context of 32 tokens",
    ),
    "unknown stop id": (
        GOOD, SamplingParams(stop_token_ids=(5, 100_000)),
        r"stop_token_ids token id 100000 is not in the vocabulary \[0, 768\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_request_is_a_value_error_raised_before_any_state_changes(engine, case):
    prompt, params, message = BAD_INPUTS[case]
    engine.add_request("busy", [9, 10, 11, 12, 13], SamplingParams(max_tokens=3))
    engine.step()
    before = _state(engine)
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert _state(engine) == before
    with pytest.raises(ValueError, match=message):
        engine.remote.reserve("bad", prompt, params)
    assert _state(engine) == before
    drive(engine)
    assert_no_leak(engine)


def test_a_prompt_one_token_short_of_the_context_generates_exactly_one_token(engine):
    prompt = random_prompts([MAX_MODEL_LEN - 1], seed=0)[0]
    engine.add_request("edge", prompt, SamplingParams(max_tokens=10, temperature=0.0))
    result = drive(engine)["edge"]
    assert len(result.token_ids) == 1 and result.finish_reason == "length"
    assert_no_leak(engine)


def test_a_prompt_larger_than_the_whole_kv_cache_is_rejected(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=4)  # 16 tokens
    with pytest.raises(ValueError, match=r"the prompt has 16 tokens but this worker's KV cache holds only 16"):
        engine.add_request("r", random_prompts([16], seed=1)[0], SamplingParams())
    assert_no_leak(engine)


def test_a_request_that_outgrows_the_whole_kv_cache_ends_with_length_instead_of_hanging(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=4)  # 16 tokens
    engine.add_request("r", random_prompts([6], seed=1)[0], SamplingParams(max_tokens=40, ignore_eos=True))
    result = drive(engine, max_steps=100)["r"]
    assert result.finish_reason == "length"
    assert len(result.token_ids) == 16 - 6
    assert_no_leak(engine)


def test_a_reused_request_id_is_rejected_while_the_first_is_alive(engine):
    engine.add_request("dup", GOOD, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"request id 'dup' is already in use"):
        engine.add_request("dup", GOOD, SamplingParams())
    with pytest.raises(ValueError, match=r"request id 'dup' is already in use"):
        engine.remote.reserve("dup", GOOD, SamplingParams())
    drive(engine)
    engine.add_request("dup", GOOD, SamplingParams(max_tokens=2))  # free again once finished
    drive(engine)
    assert_no_leak(engine)


def test_a_request_id_can_be_reused_in_the_step_right_after_it_finished(engine):
    params = SamplingParams(max_tokens=3, temperature=0.0)
    engine.add_request("dup", GOOD, params)
    first: list[int] = []
    while True:
        (out,) = engine.step()
        first.extend(out.new_token_ids)
        if out.finished:
            break
    # The runner still holds "dup" until the next step tells it the old one finished.
    engine.add_request("dup", GOOD, params)
    assert drive(engine)["dup"].token_ids == first
    assert_no_leak(engine)


# -- aborts -----------------------------------------------------------------------------------


def test_abort_of_an_unknown_request_is_a_no_op(engine):
    assert engine.abort("nobody") is False
    assert_no_leak(engine)


def test_abort_of_a_finished_request_is_a_no_op(engine):
    engine.add_request("done", GOOD, SamplingParams(max_tokens=2))
    drive(engine)
    assert engine.abort("done") is False
    assert engine.abort("done") is False
    assert_no_leak(engine)


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_cancel_frees_all_blocks(engine, steps):
    prompts = dict(zip(["a", "b", "c"], random_prompts([5, 9, 14], seed=2), strict=True))
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8, temperature=0.0))
    for _ in range(steps):
        engine.step()
    assert engine.abort("b") is True
    remaining = drive(engine)
    assert set(remaining) == {"a", "c"}  # nothing more for "b" after its abort
    assert_no_leak(engine)


def test_abort_after_preemption_frees_all_blocks(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, num_kv_blocks=12)
    prompts = dict(zip(["a", "b", "c"], random_prompts([9, 9, 9], seed=3), strict=True))
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    while not engine.scheduler.num_preemptions:
        engine.step()
    preempted = engine.scheduler.waiting[0]
    assert preempted.num_preemptions == 1
    assert engine.abort(preempted.request_id) is True
    drive(engine)
    assert_no_leak(engine)


def test_aborted_request_streams_nothing_more(engine):
    engine.add_request("a", GOOD, SamplingParams(max_tokens=10, temperature=0.0))
    engine.add_request("b", GOOD, SamplingParams(max_tokens=10, temperature=0.0))
    engine.step()
    engine.abort("a")
    later = [out.request_id for _ in range(5) for out in engine.step()]
    assert "a" not in later and "b" in later
    drive(engine)
    assert_no_leak(engine)


# -- offline API ------------------------------------------------------------------------------


def test_generate_takes_text_and_token_prompts_and_returns_them_in_order(engine):
    results = engine.generate(["The engineer reads", [5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
    assert [len(r.token_ids) for r in results] == [4, 4]
    assert results[0].prompt_token_ids == engine.tokenizer.encode("The engineer reads")
    assert results[0].text == engine.tokenizer.decode(results[0].token_ids, skip_special_tokens=True)
    assert results[1].prompt_token_ids == [5, 6, 7]
    assert all(r.finish_reason == "length" for r in results)
    assert_no_leak(engine)
