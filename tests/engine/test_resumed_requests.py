"""A request resumed with the outputs it already generated elsewhere (request migration) goes
on exactly as the undisturbed request would: same tokens under seeded sampling and penalties,
output indexes and max_tokens counted over the whole output, cached tokens only of the prompt."""

from __future__ import annotations

import pytest
from engine_harness import assert_no_leak, drive, make_engine, random_prompts

from engine.sampling_params import SamplingParams

PENALIZED = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, seed=77, ignore_eos=True,
                           presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.2)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
GREEDY_PENALIZED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                  presence_penalty=0.8, frequency_penalty=0.8)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make_engine(tiny_llama_dir)


@pytest.fixture(scope="module")
def prompt():
    return random_prompts([13], seed=31)[0]


@pytest.mark.parametrize("params", [PENALIZED, GREEDY, GREEDY_PENALIZED],
                         ids=["seeded_penalized", "greedy", "greedy_penalized"])
@pytest.mark.parametrize("done", [1, 7, 23])
def test_a_resumed_request_continues_the_undisturbed_tokens(engine, prompt, params, done):
    engine.add_request("whole", prompt, params)
    whole = drive(engine)["whole"]
    assert len(whole.token_ids) == params.max_tokens

    engine.add_request("resumed", prompt, params, resumed_output_token_ids=whole.token_ids[:done])
    resumed = drive(engine)["resumed"]
    assert resumed.token_ids == whole.token_ids[done:]
    assert resumed.finish_reason == "length"
    first, last = resumed.outputs[0], resumed.outputs[-1]
    # Indexes and usage count the whole output; the prompt stays the prompt.
    assert first.num_output_tokens - len(first.new_token_ids) == done
    assert (last.num_prompt_tokens, last.num_output_tokens) == (len(prompt), params.max_tokens)
    assert_no_leak(engine)


def test_penalties_count_resumed_tokens_as_outputs(engine, prompt):
    """Resumed as prompt tokens (the naive move) the penalties would see other counts and the
    text would change: the resumed outputs must count as outputs."""
    engine.add_request("whole", prompt, GREEDY_PENALIZED)
    whole = drive(engine)["whole"].token_ids
    done = 12
    engine.add_request("naive", prompt + whole[:done],
                       SamplingParams(**{**GREEDY_PENALIZED.__dict__, "max_tokens": 24 - done}))
    assert drive(engine)["naive"].token_ids != whole[done:], "penalties did not matter here"


def test_cached_tokens_of_a_resumed_request_count_only_its_prompt(tiny_llama_dir, prompt):
    engine = make_engine(tiny_llama_dir, enable_prefix_caching=True)
    engine.add_request("whole", prompt, GREEDY)
    whole = drive(engine)["whole"]
    engine.add_request("resumed", prompt, GREEDY, resumed_output_token_ids=whole.token_ids[:20])
    resumed = drive(engine)["resumed"]
    assert resumed.token_ids == whole.token_ids[20:]
    assert 0 < resumed.num_cached_tokens <= len(prompt)


@pytest.mark.parametrize(("resumed", "hold_kv", "message"), [
    (list(range(3, 27)), False, "leave nothing to generate"),
    ([5, 10**6], False, "outside the vocabulary"),
    ([5], True, "not held"),
])
def test_bad_resumed_outputs_are_refused_before_any_state_changes(engine, prompt, resumed,
                                                                   hold_kv, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, GREEDY, hold_kv=hold_kv,
                           resumed_output_token_ids=resumed)
    assert_no_leak(engine)
