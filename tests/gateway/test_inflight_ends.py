"""When the requests in flight will end (services/gateway/admission/inflight.py): what a
queued request's wait for a slot is judged by."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from services.gateway.admission.inflight import InFlight


@dataclass(eq=False)
class Request:
    max_output_tokens: int
    output_tokens: int = 0
    slots: int = 1
    first_token_at: float | None = 0.0


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def running(clock: Clock, inflight: InFlight, request: Request, tokens: int) -> Request:
    """`request` in flight with `tokens` streamed, one every 50 ms."""
    inflight.add(request)
    for _ in range(tokens):
        clock.now += 0.05
        request.output_tokens += 1
        inflight.tokens(request, 1)
    return request


def test_requests_that_run_to_their_max_tokens_end_there():
    """With every finished request having run to its max_tokens (ignore_eos, or completions cut
    at their limit), one asking for 250 tokens with 150 done has 100 left, not "1 token":
    judged by the average length (~90) it was, and the queue's next request was told its slot
    came at once."""
    clock = Clock()
    inflight = InFlight(clock=clock)
    for max_tokens in (40, 60, 170):  # ended at their limits: average 90
        inflight.remove(running(clock, inflight, Request(max_tokens), max_tokens))
    assert inflight.to_limit == pytest.approx(1.0)
    long = running(clock, inflight, Request(250), 150)
    assert inflight.nth_end_s(0, 0.0) == pytest.approx(100 * 0.05)
    inflight.remove(long)


def test_requests_that_stop_early_end_at_the_length_they_stop_at():
    """Chats stop on their own well before a generous max_tokens: one with 4,096 allowed and
    20 done is judged by the ~80 tokens chats have been stopping at."""
    clock = Clock()
    inflight = InFlight(clock=clock)
    for length in (80, 80, 80):
        inflight.remove(running(clock, inflight, Request(4096), length))
    assert inflight.to_limit == 0.0 and inflight.output_tokens == pytest.approx(80)
    running(clock, inflight, Request(4096), 20)
    assert inflight.nth_end_s(0, 0.0) == pytest.approx(60 * 0.05, rel=0.05)


def test_a_mix_weighs_both_ends():
    """Half of the requests ran to their limit: the expected remainder is halfway between the
    limit's and the stopping length's."""
    clock = Clock()
    inflight = InFlight(clock=clock)
    inflight.to_limit, inflight.output_tokens, inflight.time_per_token_s = 0.5, 50.0, 0.05
    running(clock, inflight, Request(200), 0)
    assert inflight.nth_end_s(0, 0.0) == pytest.approx((0.5 * 200 + 0.5 * 50) * 0.05)
