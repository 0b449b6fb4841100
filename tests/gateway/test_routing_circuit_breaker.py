"""The circuit breaker on a fake clock: consecutive health failures open it, the cool-down
ends in half-open where one trial at a time decides, failed trials back off."""

from __future__ import annotations

import grpc

from services.gateway.routing.circuit_breaker import BreakerState, CircuitBreaker

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **kw) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=3, open_s=2.0, max_open_s=5.0, clock=clock, **kw)


def test_consecutive_failures_open_it_and_a_success_in_between_resets_the_count():
    clock = Clock()
    b = breaker(clock)
    assert not b.record_failure(UNAVAILABLE) and not b.record_failure(UNAVAILABLE)
    b.record_success()
    assert not b.record_failure(UNAVAILABLE) and not b.record_failure(UNAVAILABLE)
    assert b.available()
    assert b.record_failure(UNAVAILABLE)
    assert b.state is BreakerState.OPEN and not b.available()


def test_answers_that_say_nothing_about_health_do_not_count():
    b = breaker(Clock())
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT,
                 grpc.StatusCode.CANCELLED) * 3:
        b.record_failure(code)
    assert b.state is BreakerState.CLOSED and b.consecutive_failures == 0


def test_after_the_cool_down_one_trial_at_a_time_and_its_success_closes_it():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record_failure(UNAVAILABLE)
    clock.now += 1.9
    assert not b.available()
    clock.now += 0.2
    assert b.available() and b.state is BreakerState.HALF_OPEN
    b.on_routed()  # the trial
    assert not b.available(), "a second request went in while the trial was out"
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.available()


def test_a_failed_trial_reopens_with_a_longer_cool_down_up_to_the_cap():
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record_failure(UNAVAILABLE)
    waits = []
    for _ in range(3):
        start = clock.now
        while not b.available():
            clock.now += 0.5
        waits.append(clock.now - start)
        b.on_routed()
        assert b.record_failure(UNAVAILABLE)
    assert waits == [2.0, 4.0, 5.0]
    assert b.times_opened == 4


def test_a_trial_that_never_reports_back_stops_blocking_after_its_timeout():
    clock = Clock()
    b = breaker(clock, trial_timeout_s=10.0)
    for _ in range(3):
        b.record_failure(UNAVAILABLE)
    clock.now += 2.0
    assert b.available()
    b.on_routed()  # its client went away: neither success nor failure comes
    clock.now += 9.0
    assert not b.available()
    clock.now += 2.0
    assert b.available()


def test_a_worker_state_for_metrics_reads_the_breaker_without_moving_it():
    from splitserve.v1 import common_pb2

    from services.gateway.routing.worker_pool import WorkerEndpoint
    from services.gateway.routing.worker_states import worker_state

    clock = Clock()
    endpoint = WorkerEndpoint("127.0.0.1:1", "decode", breaker=breaker(clock))
    assert worker_state(endpoint) == "unreachable"
    endpoint.reachable = True
    endpoint.health = common_pb2.HealthResponse(status=common_pb2.HealthResponse.STATUS_UNSPECIFIED)
    assert worker_state(endpoint) == "unhealthy"
    endpoint.health = common_pb2.HealthResponse(status=common_pb2.HealthResponse.SERVING)
    assert worker_state(endpoint) == "available"
    for _ in range(3):
        endpoint.breaker.record_failure(UNAVAILABLE)
    assert worker_state(endpoint) == "breaker_open"
    clock.now += 2.5  # the cool-down is over: a trial may go, so it counts as available
    assert worker_state(endpoint) == "available"
    assert endpoint.breaker.state is BreakerState.OPEN  # read, not advanced
    endpoint.draining = True
    assert worker_state(endpoint) == "draining"


def test_a_health_check_that_says_serving_closes_it_past_the_cool_down():
    """Trials alone let a recovered worker take one request at a time: streams migrating to
    it in a burst found no worker. The health poll's SERVING closes it once the cool-down is
    over, and at once for a worker that restarted (a new process)."""
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.record_failure(UNAVAILABLE)
    assert not b.health_confirmed(restarted=False)  # still cooling down
    assert b.state is BreakerState.OPEN
    clock.now += 2.5
    assert b.health_confirmed(restarted=False)
    assert b.state is BreakerState.CLOSED and b.available()
    for _ in range(3):
        b.record_failure(UNAVAILABLE)
    assert b.health_confirmed(restarted=True)  # a new process: no cool-down to sit out
    assert b.state is BreakerState.CLOSED
    assert not b.health_confirmed(restarted=False)  # closed already: nothing to do
