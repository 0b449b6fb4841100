"""A circuit breaker per worker: consecutive RPC failures take it out of rotation for a
cool-down, after which one trial request at a time probes it (half-open).

Owned by the gateway's event loop, like the endpoint that holds it; the clock is injectable
so tests drive it without sleeping.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import grpc

# Codes that say something about the worker's health. RESOURCE_EXHAUSTED (full), bad input
# and caller cancels do not: the worker answered correctly.
HEALTH_FAILURES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
})


class BreakerState(enum.Enum):
    CLOSED = "closed"  # in rotation
    OPEN = "open"  # out of rotation until the cool-down ends
    HALF_OPEN = "half_open"  # one trial request at a time decides


class CircuitBreaker:
    """`failure_threshold` consecutive failures open it for `open_s`; each failed trial
    doubles the cool-down up to `max_open_s`; a successful trial closes it. A trial that
    never reports back (its client left) stops blocking the next one after `trial_timeout_s`."""

    def __init__(self, failure_threshold: int = 3, open_s: float = 2.0, max_open_s: float = 30.0,
                 trial_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.max_open_s = max_open_s
        self.trial_timeout_s = trial_timeout_s
        self.clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.times_opened = 0
        self._cool_down_s = open_s
        self._reopen_at = 0.0
        self._trial_started: float | None = None

    def available(self) -> bool:
        """Whether a request may be routed here now (moves OPEN to HALF_OPEN when due)."""
        now = self.clock()
        if self.state is BreakerState.OPEN and now >= self._reopen_at:
            self.state = BreakerState.HALF_OPEN
            self._trial_started = None
        if self.state is BreakerState.HALF_OPEN:
            return self._trial_started is None or now - self._trial_started > self.trial_timeout_s
        return self.state is BreakerState.CLOSED

    @property
    def cooling_down(self) -> bool:
        """Open, its cool-down not over (read only: `available` is what moves it on)."""
        return self.state is BreakerState.OPEN and self.clock() < self._reopen_at

    def on_routed(self) -> None:
        """A request was routed here; in HALF_OPEN it is the trial."""
        if self.state is BreakerState.HALF_OPEN:
            self._trial_started = self.clock()

    def health_confirmed(self, restarted: bool) -> bool:
        """The worker's health check says it serves: past the cool-down (at once for a new
        process) that closes the breaker, as a successful trial would. Left to trials alone, a
        recovered worker took one request at a time, and streams migrating to it in a burst
        found no worker. True if it closed."""
        if self.state is BreakerState.CLOSED or (self.cooling_down and not restarted):
            return False
        self.record_success()
        return True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.state is not BreakerState.CLOSED:
            self.state = BreakerState.CLOSED
            self._cool_down_s = self.open_s
            self._trial_started = None

    def record_failure(self, code: grpc.StatusCode | None = None) -> bool:
        """Count a failed RPC (ignored unless `code` is a health failure); True if it opened."""
        if code is not None and code not in HEALTH_FAILURES:
            return False
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self._cool_down_s = min(self._cool_down_s * 2, self.max_open_s)
            self._open()
            return True
        if self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold:
            self._open()
            return True
        return False

    def _open(self) -> None:
        self.state = BreakerState.OPEN
        self.times_opened += 1
        self._reopen_at = self.clock() + self._cool_down_s
        self._trial_started = None
