"""Every sequence prefilling costs a first step of its own (its KV on the decode worker, its
sampling, the gateway's work for it) that no prompt token accounts for. The TTFT estimate
charges it a fitted term per extra sequence and fits its prompt-token line on sequences
prefilled alone, so that a burst of many short requests neither steepens the line that judges
long prompts nor is judged by it (first tokens below: the `make run` gateway's debug log)."""

from __future__ import annotations

import asyncio

import pytest
from admission_harness import make_admission, spec

from services.gateway.admission.capacity import CapacityRule
from services.gateway.admission.tenants import Tenant
from services.gateway.errors import APIError

A = Tenant("a")


async def _burst(admission, prompt_tokens: int, first_s: float, rest_s: float,
                 requests: int) -> list:
    """`requests` requests at once: the first stepped alone, `first_s` to its first token,
    the rest together, `rest_s` each."""
    burst = [await admission.admit(A, [spec(prompt_tokens, 16, index=i)], prompt_tokens)
             for i in range(requests)]
    for k, ticket in enumerate(burst):
        seconds = first_s if k == 0 else rest_s
        ticket.released_at -= seconds
        ticket.arrival -= seconds
        ticket._tokens(1)
    for ticket in burst:
        ticket.release()
    return burst


async def _warm_up(admission) -> None:
    """The user check's two bursts of 32 short completions, then one chat alone."""
    await _burst(admission, 7, 0.078, 0.17, 32)
    await _burst(admission, 7, 0.061, 0.15, 32)
    await _burst(admission, 37, 0.032, 0.032, 1)


def test_a_warm_up_burst_teaches_the_sequence_term_not_the_line():
    """After the warm-up, 12 chats behind a new 506-token system prompt came in 0.36 s (the
    first alone in 0.17 s); the line over every first token said 0.79 s for the last one."""

    async def scenario():
        admission = make_admission(A, rule=CapacityRule(), ttft_target_s=1.0)
        await _warm_up(admission)
        estimator = admission.estimator
        assert estimator.trusted
        assert estimator.service_at(37) == pytest.approx(0.05, abs=0.03)
        assert 0.002 < estimator.seconds_per_extra_sequence() < 0.008
        last_chat = estimator.service_at(506 + 11 * 26, 11)
        assert 0.05 < last_chat < 0.5
        assert not estimator.trusted_at(506 + 11 * 26)  # a load no chat alone came at
        # The chats' first tokens then teach the line its slope.
        await _burst(admission, 506, 0.17, 0.36, 1)
        assert 0.0001 < estimator.seconds_per_prompt_token() < 0.0004

    asyncio.run(scenario())


def test_a_burst_of_many_short_requests_does_not_lock_out_the_next():
    """104 requests of 8-25 prompt tokens at once, after the warm-up: 0.83 s to their first
    tokens, where bursts of 32 had taken 0.17 s at the same prompt-token loads. Taught to the
    line (intercept 0.57 s) and judged by it (misses of 0.7 s pinning the margin), they had
    102 of the next 104, sent 3 s later to an idle cluster, refused."""

    async def scenario():
        admission = make_admission(A, rule=CapacityRule(), ttft_target_s=1.0)
        await _warm_up(admission)
        await _burst(admission, 9, 0.10, 0.83, 104)
        estimator = admission.estimator
        assert estimator.margin(1.0) == 0.0
        assert estimator.service_at(9) < 0.15
        admitted = refused = 0
        tickets = []
        for i in range(104):
            try:
                tickets.append(await admission.admit(A, [spec(9, 16, index=i)], 9))
                admitted += 1
            except APIError as exc:
                assert exc.status == 503
                refused += 1
        assert admitted >= 90 and admitted + refused == 104
        for ticket in tickets:
            ticket.release()

    asyncio.run(scenario())


def test_long_prompts_beyond_what_was_prefilled_alone_are_not_judged_flat():
    """After the warm-up, the lone first tokens (6-37 tokens) give the line no slope; judged by
    it, 8 prompts of ~2,000 tokens sent at once would all be admitted and the last served
    seconds late. Beyond the longest load prefilled alone, each token costs what the line over
    every first token says: the first is admitted, the ones behind it are refused."""

    async def scenario():
        admission = make_admission(A, rule=CapacityRule(), ttft_target_s=1.0)
        await _warm_up(admission)
        assert admission.estimator.service_at(2000) > 0.5  # flat, it would say 0.07 s
        first = await admission.admit(A, [spec(2000, 8)], 2000)
        refused = 0
        for i in range(7):
            try:
                await admission.admit(A, [spec(2000, 8, index=i + 1)], 2000)
            except APIError as exc:
                assert exc.status == 503
                refused += 1
        assert refused == 7
        first.release()

    asyncio.run(scenario())


def test_a_slow_first_set_of_many_choices_does_not_steepen_the_line():
    """13 requests of n=8 under a regex, the first such set (grammars and tokenizers cold):
    first tokens at up to 4 s. Taught to the line over every first token (which stands in for
    prompts longer than any prefilled alone), they had the 12 chats after them, behind a new
    1,100-token system prompt, predicted 5.3 s and 11 refused; they are the term's."""

    async def scenario():
        admission = make_admission(A, rule=CapacityRule(), ttft_target_s=1.0)
        await _warm_up(admission)
        estimator = admission.estimator
        before = estimator.service_at(1100 + 11 * 26, 11)
        burst = [await admission.admit(A, [spec(24, 16, index=i) for i in range(8)], 24)
                 for _ in range(13)]
        for k, ticket in enumerate(burst):
            seconds = 1.0 + 0.25 * k
            ticket.released_at -= seconds
            ticket.arrival -= seconds
            ticket._tokens(1)
        for ticket in burst:
            ticket.release()
        assert estimator.seconds_per_extra_sequence() > 0.01
        assert estimator.service_at(1100 + 11 * 26, 11) < before + 11 * 0.05

    asyncio.run(scenario())
