"""Requests for n choices: each choice is a sequence of its own on the workers, with a first
step no prompt token accounts for. The TTFT estimate charges them a fitted term per extra
choice, so that what they teach does not steepen the prompt-token line that judges everyone
else (the `make run` user check: after 13 requests of n=8, the chats behind a new system
prompt were predicted 2.25 s and refused, and were served in 0.32 s)."""

from __future__ import annotations

import asyncio

import pytest
from admission_harness import make_admission, spec
from prometheus_client import generate_latest

from services.gateway.admission.capacity import CapacityRule
from services.gateway.admission.tenants import Tenant
from services.gateway.admission.ttft_estimator import TTFTEstimator
from services.gateway.errors import APIError

A = Tenant("a")
# What 13 requests of n=8 under a regex, 24 prompt tokens each, sent at once, took from
# release to their first tokens on `make run` (in release order; gateway debug log).
BURST_FIRST_TOKENS_S = (0.300, 0.962, 1.009, 1.010, 1.010, 1.010, 1.010, 1.010, 1.010,
                        1.182, 1.183, 1.135, 1.168)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _taught_by_chats(estimator: TTFTEstimator) -> None:
    """One choice each: 30 ms plus 0.3 ms per prompt token, loads of 24 to 1,400 tokens."""
    for _ in range(4):
        for tokens in (24, 200, 600, 1132, 1400):
            estimator.first_token(0.03 + 0.0003 * tokens, prefill_tokens=tokens)


def _choices(prompt_tokens: int, n: int) -> list:
    return [spec(prompt_tokens, 16, index=i) for i in range(n)]


async def _n8_burst(admission) -> list:
    """13 requests of n=8 at once, each first token as long after its release as measured."""
    burst = [await admission.admit(A, _choices(24, 8), 24) for _ in BURST_FIRST_TOKENS_S]
    for ticket, seconds in zip(burst, BURST_FIRST_TOKENS_S, strict=True):
        ticket.released_at -= seconds
        ticket.arrival -= seconds
        ticket._tokens(1)
    for ticket in burst:
        ticket.release()
    return burst


def test_extra_choices_teach_their_own_term_not_the_prompt_token_line():
    async def scenario():
        admission = make_admission(A, rule=CapacityRule(), ttft_target_s=1.0)
        estimator = admission.estimator
        _taught_by_chats(estimator)
        slope = estimator.seconds_per_prompt_token()
        burst = await _n8_burst(admission)
        assert [t.extra_at_release for t in burst] == [7 * (k + 1) for k in range(13)]
        assert admission.prefilling_extra == 0 and admission.prefilling_tokens == 0
        # Predicted with no term for extra choices yet: their misses are not the line's.
        assert all(t.predicted_ttft_s is None for t in burst)
        assert estimator.margin(1.0) == 0.0
        assert estimator.seconds_per_prompt_token() == pytest.approx(slope)
        assert 0.008 < estimator.seconds_per_extra_choice() < 0.02
        assert estimator.trusted_at(300, 91) and not estimator.trusted_at(300, 700)
        gauges = {line.split()[0]: float(line.split()[1]) for line in generate_latest(
            admission.metrics.registry).decode().splitlines() if line.startswith("splitserve_")}
        assert gauges["splitserve_gateway_ttft_seconds_per_extra_choice"] == pytest.approx(
            estimator.seconds_per_extra_choice())
        assert gauges["splitserve_gateway_ttft_seconds_per_prompt_token"] == pytest.approx(slope)
        # The cold system prompt right after: 1,132 tokens, predicted down the chats' line.
        cold = await admission.admit(A, [spec(1132, 24)], 1132)
        assert cold.predicted_ttft_s == 0.0
        behind = await admission.admit(A, [spec(1135, 24)], 28)
        assert behind.predicted_ttft_s == pytest.approx(0.03 + 0.0003 * 1160, rel=0.05)
        for ticket in (cold, behind):
            ticket.release()

    asyncio.run(scenario())


def test_a_second_burst_of_many_choices_is_judged_by_the_term():
    """The second time, the term is known: as many of the 13 requests are admitted as its
    estimate puts within the target, and the rest are refused at once."""

    async def scenario():
        admission = make_admission(A, rule=CapacityRule(), ttft_target_s=1.0)
        _taught_by_chats(admission.estimator)
        await _n8_burst(admission)
        admitted, refused = [], 0
        for _ in range(13):
            try:
                admitted.append(await admission.admit(A, _choices(24, 8), 24))
            except APIError as exc:
                assert exc.status == 503
                refused += 1
        assert 4 <= len(admitted) <= 10 and refused == 13 - len(admitted)
        assert all(t.predicted_ttft_s is not None for t in admitted)  # now judged
        for ticket in admitted:
            ticket.release()

    asyncio.run(scenario())


def test_traffic_of_many_choices_alone_still_gets_a_line():
    """Until the line is trusted, samples with extra choices teach it: a gateway serving only
    n=4 requests learns its first tokens, and the term is what the line leaves."""
    estimator = TTFTEstimator(clock=Clock())
    for _ in range(10):
        for k in (1, 2, 3, 4):
            estimator.first_token(0.05 + 0.04 * k, prefill_tokens=30 * k, extra_choices=3 * k)
    assert estimator.trusted
    for k in (1, 4):
        assert estimator.service_at(30 * k, 3 * k) == pytest.approx(0.05 + 0.04 * k, abs=0.02)
    assert estimator.seconds_per_extra_choice() < 0.002
