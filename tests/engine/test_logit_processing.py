"""Logit processing in the sampler: logit_bias, allowed_token_ids, min_tokens and bad words,
applied before the penalties (vLLM's order), row by row, leaving the logprobs and the other
rows of a batch as they were."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from tests.engine.test_sampler import PROBS, row


def test_logit_bias_moves_the_greedy_choice_and_leaves_the_logprobs_and_other_rows():
    logits = torch.tensor([PROBS, PROBS]).log()
    biased = row(temperature=0.0, logprobs=1, logit_bias=((3, 5.0),))
    plain = row(temperature=0.0, logprobs=1)
    tokens, logprobs = Sampler()(logits, [biased, plain])
    assert tokens == [3, 0]
    # Logprobs are the model's distribution's, as with penalties.
    assert math.isclose(logprobs[0].logprob, math.log(0.1), rel_tol=1e-5)
    assert logprobs[0].rank == 4
    assert torch.equal(logits, torch.tensor([PROBS, PROBS]).log()), "the caller's logits changed"


@pytest.mark.parametrize("batched", [False, True])
def test_logit_bias_applies_before_the_penalties_as_in_vllm(batched):
    # Token 0 was seen: biased first, -1 + 1.2 = 0.2 is positive and halves to 0.1, above
    # token 1's 0; penalised first, -1 x 2 + 1.2 = -0.8 would lose to it.
    logits = torch.tensor([[-1.0, 0.0, -5.0]])
    params = dict(temperature=0.0, token_ids=[0], num_prompt_tokens=1, repetition_penalty=2.0)
    assert Sampler(batched=batched)(logits, [row(**params)])[0] == [1]
    assert Sampler(batched=batched)(logits, [row(logit_bias=((0, 1.2),), **params)])[0] == [0]


def test_a_bias_of_minus_100_bans_a_token_from_sampling():
    logits = torch.tensor([PROBS] * 64).log()
    rows = [row(seed=s, temperature=1.0, logit_bias=((0, -100.0), (1, -100.0))) for s in range(64)]
    tokens, _ = Sampler()(logits, rows)
    assert set(tokens) <= {2, 3} and set(tokens) == {2, 3}


def test_allowed_token_ids_keep_only_those_tokens_with_their_ratios():
    logits = torch.tensor([PROBS] * 200).log()
    rows = [row(seed=s, temperature=1.0, allowed_token_ids=(1, 3)) for s in range(200)]
    tokens, _ = Sampler()(logits, rows)
    assert set(tokens) == {1, 3}
    # 0.25 : 0.1 renormalised: token 1 about 71% of the time.
    assert 0.6 < tokens.count(1) / len(tokens) < 0.82
    greedy, _ = Sampler()(logits[:1], [row(temperature=0.0, allowed_token_ids=(2, 3))])
    assert greedy == [2]


def test_min_tokens_bans_eos_and_stop_tokens_until_that_many_are_out():
    logits = torch.tensor([PROBS]).log()  # token 0 (EOS here) is the argmax
    sampler = Sampler(eos_token_ids=(0,))
    params = dict(temperature=0.0, min_tokens=3, stop_token_ids=(1,))
    # position - num_prompt_tokens = tokens out so far: 0, 1, 2 ban EOS and the stop token.
    for out in range(3):
        assert sampler(logits, [row(position=10 + out, num_prompt_tokens=10, **params)])[0] == [2]
    assert sampler(logits, [row(position=13, num_prompt_tokens=10, **params)])[0] == [0]
    # ignore_eos: EOS does not end the output, so it is not banned; the stop token still is.
    assert sampler(logits, [row(position=10, num_prompt_tokens=10, ignore_eos=True,
                                **params)])[0] == [0]


def test_bans_that_would_leave_no_token_give_way_to_the_allowed_set():
    """Only EOS allowed, and EOS banned by min_tokens: the bans give way, the allowed set
    holds (vLLM's answer: the request ends). The whole row used to be restored, so the model's
    likeliest token was taken, outside the allowed set (an engine audit: ' Paris.' for
    allowed_token_ids [EOS] and min_tokens 3)."""
    logits = torch.tensor([PROBS]).log()
    sampler = Sampler(eos_token_ids=(3,))  # not the argmax (token 0)
    stuck = row(temperature=0.0, allowed_token_ids=(3,), min_tokens=2, position=5,
                num_prompt_tokens=5)
    assert sampler(logits, [stuck])[0] == [3]
    # A bias of -inf on every allowed token leaves nothing at all: the row as it was.
    none = row(temperature=0.0, allowed_token_ids=(3,), logit_bias=((3, float("-inf")),))
    assert sampler(logits, [none])[0] == [0]


def test_logit_processing_in_a_batch_equals_each_row_alone():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    rows = [row(seed=1, temperature=0.7, logit_bias=((7, 3.0), (9, -2.0))),
            row(seed=2, temperature=0.0),
            row(seed=3, temperature=1.0, allowed_token_ids=tuple(range(10, 20)), top_p=0.9),
            row(seed=4, temperature=0.0, min_tokens=1, stop_token_ids=(int(logits[3].argmax()),),
                position=3, num_prompt_tokens=3),
            row(seed=5, temperature=1.2, repetition_penalty=1.3, token_ids=[1, 2, 3],
                logit_bias=((4, 1.0),))]
    together, _ = Sampler()(logits.clone(), rows)
    alone = [Sampler()(logits[i:i + 1].clone(), [r])[0][0] for i, r in enumerate(rows)]
    assert together == alone
    assert 10 <= together[2] < 20 and together[3] != int(logits[3].argmax())


@pytest.mark.parametrize(("fields", "message"), [
    ({"logit_bias": ((99, 1.0),)}, "logit_bias token id 99"),
    ({"logit_bias": ((1, 101.0),)}, r"\[-100, 100\]"),
    ({"logit_bias": ((1, float("nan")),)}, "finite"),
    ({"logit_bias": ((1, 1.0), (1, 2.0))}, "twice"),
    ({"allowed_token_ids": (3, -1)}, "allowed_token_ids token id -1"),
    ({"min_tokens": -1}, "min_tokens"),
])
def test_logit_processing_fields_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(max_tokens=16, **fields).validate(vocab_size=50)


def test_the_batched_draw_applies_logit_processing_too():
    logits = torch.tensor([PROBS] * 3).log()
    rows = [row(seed=1, temperature=1.0, allowed_token_ids=(2, 3)),
            row(temperature=0.0, logit_bias=((3, 5.0),)),
            row(temperature=0.0, min_tokens=1, stop_token_ids=(0,), position=4,
                num_prompt_tokens=4)]
    tokens, _ = Sampler(batched=True)(logits, rows)
    assert tokens[0] in (2, 3) and tokens[1:] == [3, 1]


def test_bad_words_ban_a_sequences_last_token_where_the_output_ends_with_the_rest():
    logits = torch.tensor([PROBS]).log()
    sampler = Sampler()

    def pick(output, **params):
        return sampler(logits, [row(temperature=0.0, token_ids=[9, 9, *output],
                                    num_prompt_tokens=2, position=2 + len(output),
                                    **params)])[0][0]

    assert pick([], bad_words_token_ids=((0,),)) == 1  # one token: always banned
    words = ((3, 0), (2, 3, 1))
    assert pick([1], bad_words_token_ids=words) == 0  # the output does not end with 3
    assert pick([1, 3], bad_words_token_ids=words) == 1  # ...now it does: 0 banned
    assert pick([2, 3, 3], bad_words_token_ids=words) == 1
    assert pick([2, 3], bad_words_token_ids=words) == 2  # 0 and 1 both banned
    # Only the output counts: the prompt ending with 3 does not ban 0.
    assert sampler(logits, [row(temperature=0.0, token_ids=[3], num_prompt_tokens=1, position=1,
                                bad_words_token_ids=words)])[0] == [0]


@pytest.mark.parametrize("batched", [False, True])
def test_a_tiny_positive_temperature_is_greedy_not_an_overflow(batched):
    """Logits over a temperature of 1e-38 overflowed to inf: the draw returned token 0 on the
    CPU path and the vocabulary size (an id past the end) on the batched one, which broke the
    engine's next step. Below 1e-5 a temperature is greedy, as in vLLM."""
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.99]])
    for temperature in (1e-38, 1e-30, 1e-6):
        tokens, _ = Sampler(batched=batched)(
            logits, [row(seed=s, temperature=temperature) for s in (1, 2)])
        assert tokens == [1, 0], (temperature, tokens)
    assert not SamplingParams(temperature=1e-5).greedy


def test_a_row_with_no_mass_still_draws_an_id_in_the_vocabulary():
    from engine.sampling_batched import kept_index

    probs = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.5, 0.5]])
    index = kept_index(probs, torch.tensor([2, 0]))
    assert index.tolist() == [2, 1]


@pytest.mark.parametrize("penalty", [1e-38, 0.009, 0.0, -1.0])
def test_a_repetition_penalty_that_would_overflow_the_logits_is_refused(penalty):
    with pytest.raises(ValueError, match="repetition_penalty must be >= 0.01"):
        SamplingParams(repetition_penalty=penalty).validate(100)
