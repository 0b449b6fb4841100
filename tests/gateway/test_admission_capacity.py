"""The capacity rule that releases queued requests (in flight, decode KV headroom, prefill
backlog from worker stats) and the TTFT estimator behind early rejection."""

from __future__ import annotations

import pytest
from admission_harness import FakeEndpoint, FakePool

from services.gateway.admission.capacity import (
    MIN_PACE_ROWS,
    CapacityRule,
    ClusterRoom,
    pace_limit,
)
from services.gateway.admission.ttft_estimator import TTFTEstimator


def test_in_flight_limits_per_gateway_and_per_decode_worker():
    pool = FakePool(FakeEndpoint(role="decode"), FakeEndpoint(role="decode"))
    room = ClusterRoom(CapacityRule(max_inflight=10, max_inflight_per_decode=2), pool)
    assert room.has_room(3, 10, 1) and not room.has_room(4, 10, 1)
    pool.endpoints[1].up = False  # one decode worker left: 2 in flight is its limit
    assert not room.has_room(2, 10, 1)
    assert not ClusterRoom(CapacityRule(max_inflight=3), pool).has_room(3, 10, 1)


def test_by_default_no_more_is_released_than_the_decoders_batch():
    pool = FakePool(FakeEndpoint(role="decode"), FakeEndpoint(role="decode"))
    for endpoint in pool.endpoints:
        endpoint.health.stats.max_running = 3
    room = ClusterRoom(CapacityRule(), pool)
    assert room.inflight_limit() == 6
    assert room.has_room(5, 10, 1) and not room.has_room(6, 10, 1)
    pool.endpoints[0].up = False
    assert room.inflight_limit() == 3
    pool.endpoints[1].health.stats.max_running = 0  # an older worker that does not say
    assert room.inflight_limit() == 0 and room.has_room(100, 10, 1)
    explicit = ClusterRoom(CapacityRule(max_inflight_per_decode=2), pool)
    assert explicit.inflight_limit() == 2


def test_a_decode_worker_behind_its_tpot_target_takes_only_what_it_can_pace():
    pool = FakePool(FakeEndpoint(role="decode"), FakeEndpoint(role="decode"))
    slow, fast = (e.health.stats for e in pool.endpoints)
    slow.max_running = fast.max_running = 128
    room = ClusterRoom(CapacityRule(tpot_target_s=0.1), pool)
    assert room.inflight_limit() == 256  # neither has reported a pace yet
    slow.token_interval_s, slow.interval_rows = 0.2, 40.0  # twice the target at 40 streams
    fast.token_interval_s, fast.interval_rows = 0.02, 10.0  # well within: not judged
    assert room.decoder_limit(slow) == 20 and room.decoder_limit(fast) == 128
    assert room.inflight_limit() == 148
    assert room.has_room(147, 10, 1) and not room.has_room(148, 10, 1)
    slow.token_interval_s = 0.07  # within the target but past half of it: room to grow, bounded
    assert room.decoder_limit(slow) == 57
    slow.token_interval_s, slow.interval_rows = 0.5, 3.0  # a handful already miss it: not held
    assert room.decoder_limit(slow) == 128
    slow.token_interval_s, slow.interval_rows = 5.0, 40.0  # held, but never below a handful
    assert room.decoder_limit(slow) == MIN_PACE_ROWS
    explicit = ClusterRoom(CapacityRule(max_inflight_per_decode=2, tpot_target_s=0.1), pool)
    assert explicit.inflight_limit() == 2 + 2  # the pace limit only ever lowers a limit
    off = ClusterRoom(CapacityRule(), pool)
    assert off.decoder_limit(slow) == 128
    slow.max_running = fast.max_running = 0  # older workers: the pace alone limits
    assert room.inflight_limit() == 0  # one of them has no limit at all
    fast.token_interval_s, fast.interval_rows = 0.3, 100.0
    assert room.inflight_limit() == MIN_PACE_ROWS + 33
    with pytest.raises(ValueError, match="tpot"):
        CapacityRule(tpot_target_s=-1)


def test_pace_limit():
    assert pace_limit(0.0, 1.0, 100) == 0  # off
    assert pace_limit(0.1, 0.05, 100) == 0  # at half the target: not judged
    assert pace_limit(0.1, 0.051, 100) == 196
    assert pace_limit(0.1, 0.1, 100) == 100
    assert pace_limit(0.1, 0.4, 100) == 25


def test_nothing_in_flight_always_has_room():
    pool = FakePool(FakeEndpoint(kv_free=0))
    assert ClusterRoom(CapacityRule(max_inflight_per_decode=1), pool).has_room(0, 10**6, 10**6)


def test_kv_headroom_counts_blocks_released_since_the_last_poll():
    decode = FakeEndpoint(role="decode", kv_free=100, kv_total=100)
    room = ClusterRoom(CapacityRule(kv_headroom=0.2), FakePool(decode))
    assert room.has_room(1, 10, 80) and not room.has_room(1, 10, 81)
    room.released(10, 50)  # not in the stats yet
    assert room.has_room(1, 10, 30) and not room.has_room(1, 10, 31)
    decode.set_stats(kv_free=50, kv_total=100)  # the poll now shows them
    assert room.has_room(1, 10, 30) and not room.has_room(1, 10, 31)
    decode.set_stats(kv_free=100, kv_total=100)  # they finished
    assert room.has_room(1, 10, 80)


def test_a_request_must_fit_in_one_decode_worker():
    pool = FakePool(FakeEndpoint(role="decode", kv_free=60), FakeEndpoint(role="decode", kv_free=60))
    room = ClusterRoom(CapacityRule(), pool)
    assert room.has_room(1, 10, 60) and not room.has_room(1, 10, 61)


def test_prefill_backlog_from_worker_stats_and_recent_releases():
    prefill = FakeEndpoint(role="prefill", queued_prefill_tokens=300)
    pool = FakePool(FakeEndpoint(role="decode"), prefill)
    room = ClusterRoom(CapacityRule(max_prefill_queue_tokens=512), pool)
    assert room.has_room(1, 100, 1)
    room.released(212, 1)
    assert not room.has_room(1, 100, 1)  # 300 queued + 212 sent since the poll
    prefill.set_stats(kv_free=0, queued_prefill_tokens=0)
    assert room.has_room(1, 100, 1)


def test_no_available_worker_releases_at_once_to_fail_fast():
    pool = FakePool(FakeEndpoint(role="decode"))
    pool.endpoints[0].up = False
    assert ClusterRoom(CapacityRule(max_inflight_per_decode=1), pool).has_room(5, 10, 10)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_drain_rate_is_measured_only_while_requests_wait():
    clock = Clock()
    estimator = TTFTEstimator(window_s=0.5, alpha=1.0, clock=clock)
    for _ in range(20):  # no backlog: arrivals set the pace, nothing is learned
        clock.now += 0.01
        estimator.released(100)
    assert estimator.requests_per_s is None
    estimator.backlog(True)
    for _ in range(10):  # backlogged: 10 requests of 100 tokens in 1 s
        clock.now += 0.1
        estimator.released(100)
    assert estimator.requests_per_s == pytest.approx(10.0)
    assert estimator.tokens_per_s == pytest.approx(1000.0)


def test_estimate_uses_the_slower_of_requests_and_tokens():
    estimator = TTFTEstimator()
    assert estimator.estimate(3, 300, 100, room_now=False) is None  # nothing measured yet
    estimator.requests_per_s, estimator.tokens_per_s, estimator.service_s = 10.0, 1000.0, 0.05
    assert estimator.estimate(0, 0, 100, room_now=True, slots_in_use=2) == pytest.approx(0.05)
    assert estimator.estimate(3, 300, 100, room_now=False) == pytest.approx(0.45)
    # Long prompts ahead: tokens, not request count, bound the wait.
    assert estimator.estimate(3, 3000, 1000, room_now=False) == pytest.approx(3.05)
    # A long prompt of its own with nothing ahead waits for a slot, not for a token rate
    # measured on others' (perhaps short) prompts: its prefill is in the service time.
    assert estimator.estimate(0, 0, 5000, room_now=False) == pytest.approx(0.15)


def test_a_stalled_backlog_slows_the_estimate_by_requests_not_by_one_token():
    """A backlog that released nothing for a whole window (the in-flight limit held it) drains
    at most half a request per busy second, and in tokens at most half an average request's:
    the wait grows with the stall, it does not jump to minutes."""
    clock = Clock()
    estimator = TTFTEstimator(window_s=0.45, alpha=1.0, clock=clock)
    estimator.backlog(True)
    for _ in range(10):  # drained 10 requests of 200 tokens a second, two whole windows
        clock.now += 0.1
        estimator.released(200)
    estimator.service_s = 0.1
    estimator.backlog(False)
    estimator.backlog(True)  # one request queued, none released for 0.6 s
    clock.now += 0.6
    stalled = estimator.estimate(1, 107, 300, room_now=False)
    # 2 requests at 0.5 / 0.6 s each, or 107 tokens at 100 / 0.6 tokens/s: 2.4 s, plus service.
    assert stalled == pytest.approx(2 / (0.5 / 0.6) + 0.1)
    assert stalled < 3.0  # as one token: 107 / (1 / 0.6) = 64 s


def test_next_in_line_waits_for_the_next_end_not_a_stale_rate_or_an_ended_backlog():
    """A request that finds the in-flight limit reached with nothing queued goes when the next
    running request ends. Neither a drain rate measured over an early backlog (1.63 req/s,
    never updated: 0.61 s on every such chat, its next slot predicted 0.03-0.1 s away) nor a
    backlog that released nothing and ended (its one request dropped, late; read as a stall,
    it added 1.6 s) says anything about that wait. A backlog now that has released nothing for a
    window does: it is a stall."""
    clock = Clock()
    estimator = TTFTEstimator(window_s=0.5, alpha=1.0, clock=clock)
    estimator.service_s, estimator.duration_s = 0.2, 6.0
    estimator.requests_per_s = 1.63
    estimator.backlog(True)
    clock.now += 0.8  # the request waited past its deadline and was dropped
    estimator.backlog(False)
    clock.now += 5.0
    wait = estimator.estimate(0, 0, 100, room_now=False, slots_in_use=17, slot_free_in_s=0.05)
    assert wait == pytest.approx(0.05 + 0.2)
    # With requests ahead, the rate still bounds the wait: 3 ahead at 1.63 a second.
    assert estimator.estimate(2, 200, 100, room_now=False, slots_in_use=17,
                              slot_free_in_s=0.3) == pytest.approx(3 / 1.63 + 0.2)
    estimator.backlog(True)  # a new backlog, as long as the old one: a stall
    clock.now += 0.8
    assert estimator.estimate(0, 0, 100, room_now=False, slots_in_use=17,
                              slot_free_in_s=0.05) == pytest.approx(0.8 / 0.5 + 0.2)


def test_an_idle_cluster_is_never_predicted_late():
    """After a burst whose first tokens took seconds, a request arriving to an idle cluster is
    admitted (predicted 0): refusing it would also keep the estimate from ever relearning."""
    estimator = TTFTEstimator(alpha=1.0)
    for inflight in range(32):  # a burst: everything released at once, first tokens late
        estimator.first_token(3.5, prefill_tokens=100 * (inflight + 1))
    assert estimator.estimate(0, 0, 100, room_now=True, slots_in_use=5,
                              prefilling_tokens=3100) == pytest.approx(3.5, rel=0.05)
    assert estimator.estimate(0, 0, 100, room_now=True, slots_in_use=0) == 0.0


def test_service_time_grows_with_the_prefill_backlog_at_release():
    """First-token time is a line in the prompt tokens to prefill before it, so a backlog
    never measured (a flood's first seconds) is predicted from the slope, not from the
    quiet figure."""
    estimator = TTFTEstimator(clock=Clock())  # no time passes: nothing fades
    for _ in range(50):
        for tokens in (100, 300, 500):
            estimator.first_token(0.05 + 0.001 * tokens, prefill_tokens=tokens)
    assert estimator.service_at(100) == pytest.approx(0.15, rel=0.02)
    assert estimator.service_at(2000) == pytest.approx(2.05, rel=0.02)  # never seen: extrapolated
    assert estimator.seconds_per_prompt_token() == pytest.approx(0.001, rel=0.02)
    assert estimator.estimate(0, 0, 100, room_now=True, slots_in_use=3,
                              prefilling_tokens=1900) == pytest.approx(2.05, rel=0.02)
