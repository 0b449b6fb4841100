"""The batched draw (engine/sampling_batched.py, the GPU's) against the host-guided draw the CPU
uses (engine/sampling_draw.py): the same token for the same (seed, position), except where two
tokens' probabilities are equal to float rounding (the sums run in another order, and a sort
may order exact ties either way). Run here on CPU tensors; the ops are the same on CUDA."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, SamplingRow
from engine.sampling_batched import draw_batched, kept_index
from engine.sampling_draw import _kept, draw, truncates
from engine.sampling_params import SamplingParams
from tests.engine.test_sampling_draw import CASES, GRID, _logits


def batched(scaled: torch.Tensor, params: list[SamplingParams], uniforms: list[float]) -> list[int]:
    def column(values, dtype):
        return torch.tensor(values, dtype=dtype)

    return draw_batched(
        scaled, column([p.top_k for p in params], torch.long),
        column([p.top_p for p in params], torch.float32),
        column([p.min_p for p in params], torch.float32),
        column(uniforms, torch.float64),
        any_truncated=any(truncates(p) for p in params),
        any_full=not all(truncates(p) for p in params)).tolist()


@pytest.mark.parametrize(("kind", "params"), CASES, ids=[f"{k}-{p}" for k, p in CASES])
def test_the_batched_draw_picks_the_host_draws_token(kind, params):
    vocab = 3000
    sampling = SamplingParams(max_tokens=1, **params)
    scaled = (_logits(kind, vocab) / sampling.temperature)[None].expand(GRID, vocab)
    uniforms = [(j + 0.5) / GRID for j in range(GRID)]
    ours = batched(scaled, [sampling] * GRID, uniforms)
    theirs = draw(scaled, [sampling] * GRID, uniforms)
    probs = scaled[0].softmax(-1)
    differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    ties = [(a, b) for a, b in differ if abs(float(probs[a] - probs[b])) <= 1e-5 * float(probs[b])]
    assert len(differ) - len(ties) <= 1, differ[:10]  # a uniform on a rounded boundary, at most
    if kind != "ties":  # exact ties may be ordered either way; elsewhere they are rare
        assert len(differ) <= GRID // 200, differ[:10]


def test_a_mixed_batch_draws_each_row_as_the_host_draw_does():
    vocab = 3000
    rows = [
        (_logits("peaked", vocab), SamplingParams(max_tokens=1, temperature=0.8, top_p=0.95)),
        (_logits("flat", vocab), SamplingParams(max_tokens=1, temperature=1.0, top_p=0.99)),
        (_logits("peaked", vocab), SamplingParams(max_tokens=1, temperature=1.0)),
        (_logits("masked", vocab), SamplingParams(max_tokens=1, top_k=50)),
        (_logits("peaked", vocab), SamplingParams(max_tokens=1, temperature=0.7, min_p=0.1)),
    ]
    scaled = torch.stack([logits / p.temperature for logits, p in rows])
    params = [p for _, p in rows]
    for u in (0.01, 0.37, 0.5, 0.93, 0.999):
        assert batched(scaled, params, [u] * len(rows)) == draw(scaled, params, [u] * len(rows))


def test_kept_index_moves_off_zero_entries_as_the_host_loop_does():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0],
                          [0.0, 0.0, 0.0, 0.2, 0.8],
                          [0.3, 0.3, 0.4, 0.0, 0.0],
                          [0.0, 0.0, 1.0, 0.0, 0.0]])
    for index in ([0, 0, 4, 4], [2, 1, 3, 0], [4, 4, 0, 2], [1, 3, 2, 1]):
        got = kept_index(probs, torch.tensor(index)).tolist()
        assert got == _kept(probs, list(index)), index


def sampler_rows() -> list[SamplingRow]:
    history = list(range(40, 90))
    settings = [
        dict(temperature=0.0, logprobs=3),
        dict(temperature=0.9, top_p=0.9, seed=1, logprobs=0),
        dict(temperature=1.1, seed=2),
        dict(temperature=0.0, repetition_penalty=1.3),
        dict(temperature=0.7, top_k=20, seed=4, logprobs=5, presence_penalty=0.5),
        dict(temperature=1.0, min_p=0.05, seed=5, frequency_penalty=0.3),
    ]
    return [SamplingRow(SamplingParams(max_tokens=8, **kw), seed=kw.get("seed", 0),
                        position=60 + i, token_ids=history, num_prompt_tokens=30)
            for i, kw in enumerate(settings)]


def test_the_batched_sampler_gives_the_host_samplers_tokens_and_logprobs():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(11)) * 3
    want_tokens, want_logprobs = Sampler(batched=False)(logits, sampler_rows())
    got_tokens, got_logprobs = Sampler(batched=True)(logits, sampler_rows())
    assert got_tokens == want_tokens
    for got, want in zip(got_logprobs, want_logprobs, strict=True):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.rank == want.rank and got.top.keys() == want.top.keys()
            assert abs(got.logprob - want.logprob) < 1e-6


def test_an_all_greedy_batch_needs_no_draw():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    rows = [SamplingRow(SamplingParams(max_tokens=1, temperature=0.0), 0, 5, [1, 2], 2)] * 3
    tokens, logprobs = Sampler(batched=True)(logits, rows)
    assert tokens == logits.argmax(-1).tolist() and logprobs == [None] * 3


@pytest.mark.gpu
def test_on_cuda_penalties_and_sampling_queue_without_waiting_until_the_fetch():
    """Every list the sampler moves to the GPU (penalty columns, counted token ids, per-row
    settings) goes through pinned memory without a sync: CUDA's sync debug mode raises on any
    wait (a pageable copy, .item(), .tolist()) before the final fetch, which is let through.
    Tokens equal the host sampler's on the CPU."""
    from engine import sampler as sampler_module

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(11)) * 3
    want, _ = Sampler(batched=False)(logits, sampler_rows())
    fetch = sampler_module.fetch

    def fetch_allowed(*tensors):
        torch.cuda.set_sync_debug_mode(0)
        return fetch(*tensors)

    sampler_module.fetch = fetch_allowed
    # Made before the mode is set: a copy from pageable memory waits, and would raise.
    device_logits, sampler, rows = logits.cuda(), Sampler(batched=True), sampler_rows()
    try:
        torch.cuda.set_sync_debug_mode("error")
        got, _ = sampler(device_logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
        sampler_module.fetch = fetch
    assert got == want
