"""Sampler on small hand-built logits: greedy argmax, top-k / top-p / min-p filtering (also
against transformers' own warpers), penalties, logprobs, and the per-request (seed, position)
randomness that makes a draw independent of the batch around it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.sampler import Sampler, SamplingRow, _apply_penalties, _filter, top_logprobs
from engine.sampling_params import SamplingParams

PROBS = [0.5, 0.25, 0.15, 0.1]  # tokens 0..3, already sorted
LOGITS = torch.tensor([PROBS]).log()


def row(seed: int = 0, position: int = 10, token_ids=(), num_prompt_tokens: int = 0, **params) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params), seed=seed, position=position,
        token_ids=list(token_ids), num_prompt_tokens=num_prompt_tokens,
    )


def kept(logits: torch.Tensor, **params) -> set[int]:
    probs = _filter(logits.clone(), [row(**params)])
    return set(torch.nonzero(probs[0]).flatten().tolist())


# -- filters --------------------------------------------------------------------------------


@pytest.mark.parametrize(("top_k", "expected"), [(0, {0, 1, 2, 3}), (-1, {0, 1, 2, 3}), (1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (99, {0, 1, 2, 3})])
def test_top_k_keeps_the_k_most_likely(top_k, expected):
    assert kept(LOGITS, top_k=top_k) == expected


@pytest.mark.parametrize(("top_p", "expected"), [(1.0, {0, 1, 2, 3}), (0.45, {0}), (0.55, {0, 1}), (0.7, {0, 1}), (0.8, {0, 1, 2}), (0.95, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, expected):
    assert kept(LOGITS, top_p=top_p) == expected


@pytest.mark.parametrize(("min_p", "expected"), [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2}), (0.35, {0, 1}), (0.6, {0}), (1.0, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p, expected):
    assert kept(LOGITS, min_p=min_p) == expected


def test_top_p_applies_after_top_k_renormalises():
    # Alone, top_p=0.8 keeps three tokens (0.75 ahead of token 2). After top_k=3 the kept
    # mass is 0.9, so 0.75 / 0.9 = 0.83 is ahead of token 2 and it is dropped.
    assert kept(LOGITS, top_p=0.8) == {0, 1, 2}
    assert kept(LOGITS, top_k=3, top_p=0.8) == {0, 1}


def test_min_p_cuts_first_and_top_p_runs_on_the_mass_it_left():
    # vLLM's order. Min-p 0.25 keeps {0, 1, 2} (mass 0.9); top_p 0.8 on that mass renormalised
    # has 0.75 / 0.9 = 0.83 ahead of token 2, so it is dropped. (Top-p first, on the whole
    # distribution, would keep token 2: 0.75 ahead of it.)
    assert kept(LOGITS, min_p=0.25) == {0, 1, 2}
    assert kept(LOGITS, top_p=0.8) == {0, 1, 2}
    assert kept(LOGITS, min_p=0.25, top_p=0.8) == {0, 1}
    assert kept(LOGITS, min_p=0.25, top_k=3, top_p=0.8) == {0, 1}


def test_filtered_probabilities_keep_the_ratios_of_the_kept_tokens():
    probs = _filter(LOGITS.clone(), [row(top_k=2)])[0]
    assert probs[2] == 0 and probs[3] == 0
    assert math.isclose(float(probs[0] / probs[1]), 2.0, rel_tol=1e-6)


def test_ties_at_the_top_k_threshold_are_kept():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert kept(logits, top_k=2) == {0, 1, 2}


def test_each_row_is_filtered_with_its_own_parameters():
    logits = LOGITS.repeat(4, 1)
    rows = [row(top_k=1), row(top_p=0.7), row(min_p=0.35), row()]
    probs = _filter(logits.clone(), rows)
    kept_sets = [set(torch.nonzero(p).flatten().tolist()) for p in probs]
    assert kept_sets == [{0}, {0, 1}, {0, 1}, {0, 1, 2, 3}]


def test_a_row_without_top_p_is_not_truncated_when_a_neighbour_uses_it():
    # The unfiltered row has a long tail whose float32 cumulative sum reaches 1.0 before the
    # end; a neighbour with top_p < 1 must not make the tail of this row disappear.
    tail = torch.full((1, 2000), -30.0)
    logits = torch.cat([torch.tensor([[20.0]]), tail], dim=1).repeat(2, 1)
    alone = _filter(logits[:1].clone(), [row()])
    together = _filter(logits.clone(), [row(), row(top_p=0.5)])
    assert torch.equal(alone[0] > 0, together[0] > 0)
    assert bool((alone[0] > 0).all())


@pytest.mark.parametrize("seed", range(5))
def test_filters_agree_with_transformers_warpers(seed):
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 64, generator=generator) * 3
    settings = dict(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)
    # vLLM's order: min-p on the whole distribution, then top-k, then top-p renormalised.
    ref = TemperatureLogitsWarper(0.7)(None, logits.clone())
    ref = MinPLogitsWarper(0.05)(None, ref)
    ref = TopKLogitsWarper(20)(None, ref)
    ref = TopPLogitsWarper(0.8)(None, ref)
    ours = _filter(logits.clone() / 0.7, [row(**settings)])
    assert set(torch.nonzero(ours[0]).flatten().tolist()) == set(torch.nonzero(ref[0] > -math.inf).flatten().tolist())
    torch.testing.assert_close(ours[0] / ours[0].sum(), ref[0].softmax(-1))


# -- greedy, penalties, logprobs ------------------------------------------------------------


def test_greedy_takes_the_argmax_and_ignores_the_seed():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.99]])
    sampler = Sampler()
    for seed in range(5):
        tokens, _ = sampler(logits, [row(seed=seed, temperature=0.0), row(seed=seed + 9, temperature=0.0)])
        assert tokens == [1, 0]


def test_greedy_rows_are_unaffected_by_sampled_neighbours():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]] * 3)
    tokens, _ = Sampler()(logits, [row(temperature=1.5), row(temperature=0.0), row(temperature=2.0, seed=4)])
    assert tokens[1] == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    _apply_penalties(logits, row(token_ids=[0, 1, 1], num_prompt_tokens=3, repetition_penalty=2.0))
    assert logits.tolist() == [1.0, -4.0, 1.0, 0.5]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 50, generator=generator)
    seen = [3, 7, 7, 20, 41]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), logits.clone())
    ours = logits[0].clone()
    _apply_penalties(ours, row(token_ids=seen, num_prompt_tokens=2, repetition_penalty=1.3))
    torch.testing.assert_close(ours, ref[0])


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.zeros(5)
    # Prompt [4, 4]; output [1, 2, 2, 2].
    _apply_penalties(
        logits, row(token_ids=[4, 4, 1, 2, 2, 2], num_prompt_tokens=2, presence_penalty=0.5, frequency_penalty=0.25)
    )
    assert logits.tolist() == [0.0, -0.75, -1.25, 0.0, 0.0]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    params = dict(temperature=0.0, token_ids=[0, 0], num_prompt_tokens=0)
    assert Sampler()(logits, [row(**params)])[0] == [0]
    assert Sampler()(logits, [row(frequency_penalty=0.5, **params)])[0] == [1]


def test_penalties_do_not_leak_into_the_caller_logits_or_the_logprobs():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    original = logits.clone()
    tokens, (lp,) = Sampler()(logits, [row(temperature=0.0, token_ids=[0], repetition_penalty=10.0, logprobs=2)])
    assert torch.equal(logits, original)
    assert tokens == [1]
    # Logprobs are of the model's distribution (before penalties and temperature).
    expected = original[0].log_softmax(-1)
    assert math.isclose(lp.logprob, float(expected[1]), abs_tol=1e-6)
    assert lp.rank == 2
    assert set(lp.top) == {0, 1}


def test_logprobs_report_the_sampled_token_its_rank_and_the_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    tokens, (lp,) = Sampler()(logits, [row(temperature=0.0, logprobs=3)])
    expected = logits[0].log_softmax(-1)
    assert tokens == [1] and lp.rank == 1
    assert list(lp.top) == [1, 2, 0]
    for token, value in lp.top.items():
        assert math.isclose(value, float(expected[token]), abs_tol=1e-6)
    _, (none,) = Sampler()(logits, [row(temperature=0.0)])
    assert none is None
    _, (zero,) = Sampler()(logits, [row(temperature=0.0, logprobs=0)])
    assert zero.top == {} and math.isclose(zero.logprob, float(expected[1]), abs_tol=1e-6)


class _LogSoftmaxShapes(TorchFunctionMode):
    """Records the shape of every log_softmax input (method, torch.* or functional form)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == "log_softmax":
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def test_logprobs_are_computed_only_for_the_rows_that_ask():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 64, generator=generator) * 2
    rows = [
        row(temperature=0.0),
        row(temperature=0.0, logprobs=2),
        row(seed=1, temperature=0.9, top_p=0.9),
        row(seed=2, temperature=0.7, logprobs=0, token_ids=[5, 9], repetition_penalty=1.5),
        row(seed=3, temperature=1.0, presence_penalty=0.5, token_ids=[1, 2, 3]),
        row(seed=4, temperature=1.2, logprobs=5, min_p=0.1),
    ]
    with _LogSoftmaxShapes() as recorded:
        tokens, logprobs = Sampler()(logits, rows)
    assert recorded.shapes == [(3, 64)]  # rows 1, 3 and 5 only, in one call
    reference = logits.log_softmax(-1)  # the full-batch computation this replaces
    for i, r in enumerate(rows):
        if r.params.logprobs is None:
            assert logprobs[i] is None
            continue
        lp, ref = logprobs[i], top_logprobs(reference[i], tokens[i], r.params.logprobs)
        assert math.isclose(lp.logprob, ref.logprob, abs_tol=1e-6) and lp.rank == ref.rank
        assert list(lp.top) == list(ref.top)
        for token, value in lp.top.items():
            assert math.isclose(value, ref.top[token], abs_tol=1e-6)
    with _LogSoftmaxShapes() as recorded:
        Sampler()(logits, [row(temperature=0.0)] * 6)
    assert recorded.shapes == []
    with _LogSoftmaxShapes() as recorded:
        Sampler()(logits, [row(temperature=0.0, logprobs=1)] * 6)
    assert recorded.shapes == [(6, 64)]


# -- seeded randomness ----------------------------------------------------------------------


def test_same_seed_and_position_give_the_same_token_whatever_the_batch():
    generator = torch.Generator().manual_seed(0)
    vocab = 300
    target = torch.randn(vocab, generator=generator) * 2
    others = torch.randn(6, vocab, generator=generator) * 2
    params = dict(temperature=0.9, top_p=0.95, top_k=100)
    sampler = Sampler()
    for seed in range(20):
        alone, _ = sampler(target[None], [row(seed=seed, position=33, **params)])
        neighbours = [
            row(seed=seed, position=34, **params),  # same seed, next position
            row(seed=seed + 1, position=33, **params),  # same position, another seed
            row(temperature=0.0),
            row(seed=7, position=2, temperature=1.0, min_p=0.2),
            row(seed=seed, position=33, temperature=0.5),  # same noise, other params
        ]
        for count in (1, 3, 5):
            batch = torch.cat([others[:count], target[None]])
            tokens, _ = sampler(batch, neighbours[:count] + [row(seed=seed, position=33, **params)])
            assert tokens[-1] == alone[0], (seed, count)
            batch = torch.cat([target[None], others[:count]])
            tokens, _ = sampler(batch, [row(seed=seed, position=33, **params)] + neighbours[:count])
            assert tokens[0] == alone[0], (seed, count)


def test_different_seeds_or_positions_draw_differently():
    logits = torch.zeros(1, 1000)  # uniform: a repeated draw would be a coincidence
    sampler = Sampler()
    by_seed = {sampler(logits, [row(seed=s, position=5)])[0][0] for s in range(20)}
    by_position = {sampler(logits, [row(seed=3, position=p)])[0][0] for p in range(20)}
    assert len(by_seed) > 15 and len(by_position) > 15


def test_sampling_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    temperature = 0.8
    n = 4000
    batch = logits.repeat(n, 1)
    tokens, _ = Sampler()(batch, [row(seed=s, position=0, temperature=temperature) for s in range(n)])
    counts = torch.bincount(torch.tensor(tokens), minlength=4).double()
    expected = (logits[0] / temperature).softmax(-1).double() * n
    # Chi-square with 3 degrees of freedom: 16.3 is the 0.1% tail.
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.3, (counts.tolist(), expected.tolist())


def test_filtered_tokens_are_never_sampled():
    logits = LOGITS.repeat(500, 1)
    tokens, _ = Sampler()(logits, [row(seed=s, top_k=2) for s in range(500)])
    assert set(tokens) == {0, 1}


def test_the_uniforms_and_draws_for_a_seed_and_position_are_the_same_in_another_process():
    # Python salts str hashes per process; the (seed, position) key must not depend on that.
    # The speculative draws (draw_from) invert at these uniforms.
    import os
    import subprocess
    import sys
    from pathlib import Path

    from engine.sampling_batched import draw_from
    from engine.sampling_draw import uniform_for

    code = (
        "import torch; from engine.sampling_draw import uniform_for; "
        "from engine.sampling_batched import draw_from; "
        "u = [uniform_for(2024, p, s) for p in range(17, 21) for s in (0xC0F, 0xD4AF)]; "
        "print(u, draw_from(torch.linspace(0, 1, 50).repeat(8, 1), u).tolist())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONHASHSEED": "123"},
    ).stdout
    here = [uniform_for(2024, p, s) for p in range(17, 21) for s in (0xC0F, 0xD4AF)]
    assert len(set(here)) == 8
    assert out.strip() == f"{here} {draw_from(torch.linspace(0, 1, 50).repeat(8, 1), here).tolist()}"


def test_penalties_and_logprobs_in_a_batch_equal_each_row_alone():
    from engine.sampler import sampling_probs

    generator = torch.Generator().manual_seed(3)
    vocab = 500
    logits = torch.randn(5, vocab, generator=generator) * 2
    history = torch.randint(0, vocab, (5, 40), generator=generator).tolist()
    params = [
        dict(temperature=0.9, repetition_penalty=1.3, logprobs=3),
        dict(temperature=0.9),
        dict(temperature=1.0, presence_penalty=0.7, frequency_penalty=0.4, logprobs=0),
        dict(temperature=0.0, repetition_penalty=0.8, frequency_penalty=1.0, logprobs=5),
        dict(temperature=0.7, top_p=0.9, presence_penalty=-0.5),
    ]
    rows = [row(seed=i, position=40, token_ids=history[i], num_prompt_tokens=25, **p)
            for i, p in enumerate(params)]
    together = sampling_probs(logits, rows)
    tokens, logprobs = Sampler()(logits, rows)
    for i, r in enumerate(rows):
        if r.params.temperature > 0:
            # (a neighbour's top-p renormalises every row: equal to rounding, not bit for bit)
            assert torch.allclose(together[i], sampling_probs(logits[i:i + 1], [r])[0],
                                  rtol=1e-6, atol=0), i
        alone_tokens, alone_logprobs = Sampler()(logits[i:i + 1], [r])
        assert tokens[i] == alone_tokens[0] and logprobs[i] == alone_logprobs[0], i
    assert logprobs[1] is None and logprobs[2].top == {} and len(logprobs[3].top) == 5
