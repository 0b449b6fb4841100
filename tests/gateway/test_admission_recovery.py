"""Admission never locks itself out: what a burst taught the TTFT estimator fades, an idle
cluster takes any request, the expiry of queued requests is judged at the load they would be
released into, and short prompts are not judged by long prompts' first tokens."""

from __future__ import annotations

import asyncio

import pytest
from admission_harness import make_admission, spec

from services.gateway.capacity import CapacityRule
from services.gateway.tenants import Tenant
from services.gateway.ttft_estimator import TTFTEstimator

A = Tenant("a")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _burst(estimator: TTFTEstimator, seconds: float = 3.5, size: int = 32) -> None:
    """What a burst of `size` requests released at once teaches: first tokens `seconds` late
    at every load level, predictions off by as much."""
    for inflight in range(size):
        estimator.first_token(seconds, 0.2, seconds, inflight_at_release=inflight,
                              prompt_tokens=128)


def test_after_a_burst_an_idle_cluster_serves_the_next_request():
    """The lock-out of the first wave: after a burst pushed the average first-token time past
    the 1 s target, a request queued into an idle cluster was dropped as late before it could
    be released, so nothing was ever released (or learned) again."""

    async def scenario():
        admission = make_admission(A, rule=CapacityRule(), ttft_target_s=1.0)
        _burst(admission.estimator)
        assert admission.estimator.service_s > 1.0
        ticket = await asyncio.wait_for(admission.admit(A, [spec(4, 4)], 4), 1.0)
        assert ticket.released_at is not None and admission.inflight == 1
        ticket.release()
        return admission

    admission = asyncio.run(scenario())
    assert admission.metrics.rejected.labels("a", "ttft_expired")._value.get() == 0
    assert admission.metrics.rejected.labels("a", "ttft_predicted")._value.get() == 0


def test_a_queued_request_expires_by_the_load_it_would_be_released_into():
    """With one request in flight and a quick first token measured at that load, a queued
    request is not dropped because a burst once took seconds at a higher load."""

    async def scenario():
        admission = make_admission(A, rule=CapacityRule(max_inflight=1), ttft_target_s=1.0)
        estimator = admission.estimator
        for inflight in range(8, 32):  # the burst: slow at high load only
            estimator.first_token(3.5, inflight_at_release=inflight, prompt_tokens=10)
        for _ in range(3):
            estimator.first_token(0.05, inflight_at_release=1, prompt_tokens=10)
        first = await admission.admit(A, [spec()], 10)
        waiting = asyncio.create_task(admission.admit(A, [spec()], 10))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and len(admission.queue) == 1  # waiting, not dropped
        first.release()
        second = await asyncio.wait_for(waiting, 1.0)
        second.release()

    asyncio.run(scenario())


def test_a_load_level_not_measured_lately_fades_towards_the_level_below():
    clock = Clock()
    estimator = TTFTEstimator(alpha=1.0, clock=clock, half_life_s=10.0)
    estimator.first_token(0.2, inflight_at_release=1)
    estimator.first_token(3.0, inflight_at_release=20)
    assert estimator.service_at(20) == pytest.approx(3.0)
    clock.now = 10.0  # one half-life without a sample at either level
    assert estimator.service_at(20) == pytest.approx(0.2 + 2.8 / 2)
    clock.now = 100.0
    assert estimator.service_at(20) == pytest.approx(0.2, abs=0.01)
    estimator.first_token(2.0, inflight_at_release=20)  # fresh evidence counts in full
    assert estimator.service_at(20) == pytest.approx(2.0)


def test_a_new_sample_after_a_quiet_spell_outweighs_the_old_average():
    clock = Clock()
    estimator = TTFTEstimator(alpha=0.3, clock=clock, half_life_s=10.0)
    estimator.first_token(3.0, inflight_at_release=4)
    clock.now = 0.1
    estimator.first_token(0.1, inflight_at_release=4)
    soon = estimator.service_at(4)
    assert soon == pytest.approx(0.7 * 3.0 + 0.3 * 0.1, rel=0.01)
    clock.now = 60.0
    estimator.first_token(0.1, inflight_at_release=4)
    assert estimator.service_at(4) < 0.2 < soon


def test_short_prompts_are_not_judged_by_long_prompts_first_tokens():
    """At the same load, a 64-token prompt's first token comes sooner than a 512-token one's;
    one average over both would refuse short prompts the cluster serves on time."""
    estimator = TTFTEstimator(alpha=0.3, clock=Clock())
    for _ in range(60):
        estimator.first_token(0.10, inflight_at_release=1, prompt_tokens=64)
        estimator.first_token(1.30, inflight_at_release=1, prompt_tokens=512)
    assert estimator.seconds_per_prompt_token() == pytest.approx(1.2 / 448, rel=0.05)
    assert estimator.service_at(1, 64) == pytest.approx(0.10, abs=0.1)
    assert estimator.service_at(1, 512) == pytest.approx(1.30, abs=0.1)
    assert estimator.service_at(1, 64) < 0.3 < 1.0 < estimator.service_at(1, 512)


def test_one_prompt_length_gives_no_slope():
    estimator = TTFTEstimator(clock=Clock())
    for seconds in (0.1, 0.5, 0.3):
        estimator.first_token(seconds, inflight_at_release=1, prompt_tokens=128)
    assert estimator.seconds_per_prompt_token() == 0.0


def test_old_errors_leave_the_margin():
    clock = Clock()
    estimator = TTFTEstimator(clock=clock, error_window_s=60.0)
    for _ in range(30):  # a burst's predictions, all 0.4 s too low
        estimator.first_token(0.5, 0.1, 0.5, inflight_at_release=2)
    assert estimator.margin(1.0) == pytest.approx(0.4)
    clock.now = 61.0
    assert estimator.margin(1.0) == 0.0
