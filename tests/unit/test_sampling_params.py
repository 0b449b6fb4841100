"""SamplingParams.validate: every bad field is a ValueError naming the field and the fix."""

from __future__ import annotations

import math

import pytest

from engine.sampling_params import SamplingParams

VOCAB = 100


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": -3}, r"max_tokens must be an integer >= 1, got -3"),
        ({"max_tokens": 2.5}, r"max_tokens must be an integer >= 1, got 2.5"),
        ({"temperature": math.nan}, r"temperature must be a finite number, got nan"),
        ({"temperature": math.inf}, r"temperature must be a finite number, got inf"),
        ({"temperature": -0.5}, r"temperature must be in \[0, 2\], got -0.5"),
        ({"temperature": 2.01}, r"temperature must be in \[0, 2\], got 2.01"),
        ({"temperature": "hot"}, r"temperature must be a finite number, got 'hot'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": -0.1}, r"top_p must be in \(0, 1\], got -0.1"),
        ({"top_p": 1.01}, r"top_p must be in \(0, 1\], got 1.01"),
        ({"top_p": math.nan}, r"top_p must be a finite number, got nan"),
        ({"top_k": 1.5}, r"top_k must be an integer, got 1.5"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\], got 1.5"),
        ({"min_p": math.nan}, r"min_p must be a finite number"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be >= 0.01, got 0.0"),
        ({"repetition_penalty": 0.0099}, r"repetition_penalty must be >= 0.01"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ({"frequency_penalty": -math.inf}, r"frequency_penalty must be a finite number"),
        ({"seed": "42"}, r"seed must be an integer, got '42'"),
        ({"stop_token_ids": (VOCAB,)}, r"stop_token_ids token id 100 is not in the vocabulary \[0, 100\)"),
        ({"stop_token_ids": (-1,)}, r"stop_token_ids token id -1 is not in the vocabulary"),
        ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
        ({"logprobs": -1}, r"logprobs must be an integer in \[0, 20\], got -1"),
        ({"prompt_logprobs": 50}, r"prompt_logprobs must be an integer in \[0, 20\], got 50"),
        # A float count would otherwise reach torch.topk inside the engine loop and crash it.
        ({"logprobs": 2.5}, r"logprobs must be an integer in \[0, 20\], got 2.5"),
        ({"prompt_logprobs": 1.0}, r"prompt_logprobs must be an integer in \[0, 20\], got 1.0"),
    ],
)
def test_invalid_field_raises_a_value_error_that_names_it(fields, message):
    params = SamplingParams(**fields)
    with pytest.raises(ValueError, match=message):
        params.validate(VOCAB)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 0.0},
        {"temperature": 0},  # an int from JSON is a number too
        {"top_p": 1.0, "top_k": -1, "min_p": 0.0},
        {"top_p": 1e-6, "top_k": 1, "min_p": 1.0},
        {"max_tokens": 1, "stop_token_ids": (0, VOCAB - 1)},
        {"logprobs": 0, "prompt_logprobs": 20},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3},
        {"seed": 0},
        # The documented minimum as the gateway rounds it to float32 (0.0099999998): a 400
        # where vLLM serves it, until compared as a float32.
        {"repetition_penalty": 0.009999999776482582},
        {"repetition_penalty": 0.01},
    ],
)
def test_valid_params_pass(fields):
    SamplingParams(**fields).validate(VOCAB)


def test_greedy_means_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_needs_penalties_only_when_a_penalty_is_set():
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties


def test_params_are_immutable():
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.max_tokens = 3  # type: ignore[misc]


def test_a_seed_of_minus_one_asks_for_a_random_one_as_in_vllm():
    """It sampled as a fixed seed (the same text as another seed's, after the modulus);
    vLLM takes -1 as no seed."""
    from services.gateway.api.preprocess import SEED_MODULUS, _seed

    drawn = {_seed(-1, 0) for _ in range(4)}
    assert len(drawn) == 4 and all(0 <= s < 2**62 for s in drawn)
    assert _seed(-2, 0) == _seed(-2, 0) == SEED_MODULUS - 2 == 2**64 - 2
    assert _seed(7, 1) == 8


def test_distinct_seeds_draw_distinct_uniforms_where_pythons_hash_collided():
    """Python's int hash is modulo 2^61 - 1: seeds s and s + 2^61 - 1 drew the same text."""
    from engine.sampling_draw import uniform_for

    for position in (0, 1, 17, 4095):
        seeds = (5, 5 + 2**61 - 1, 2**63 + 5, 2**64 - 1, 0)
        assert len({uniform_for(s, position) for s in seeds}) == len(seeds)
