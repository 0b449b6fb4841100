"""The Retry-After of a capacity refusal (503): when the refused client should come back.

No sooner than the earliest its request could be on time (how far the predicted time to first
token overshoots its budget: the backlog ahead drains that long), and after the clients refused
before it, each given the cluster's time per request: a burst's refusals come back spread at
the rate the cluster serves instead of all together a second later, to be refused again. (The
OpenAI SDK honours Retry-After up to 60 s and retries twice by default: with every refusal of a
48-request burst told "1", 17 clients spent both retries in under 3 s while the burst took 17 s
to serve, and raised InternalServerError.) Owned by the gateway's event loop.

The schedule holds only what the backlog can use: it never runs past the longest wait it can
say (MAX_RETRY_AFTER_S), and a request that finds room at once clears it (`room`): the
clients told to come back later will find room too. Before, every refusal pushed it on for
good: an audit's client that retried 50 ms after each refusal, ignoring the header, was refused
2,308 times in 15 s, and for minutes after, with the cluster idle again, every refusal of
everyone said `Retry-After: 60`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Clients (the OpenAI SDK among them) ignore a Retry-After past a minute and back off on their
# own; a longer wait is not worth saying.
MAX_RETRY_AFTER_S = 60


class RetrySchedule:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._next = 0.0  # when the next refused client may come back, at the earliest

    def retry_after_s(self, earliest_s: float, per_request_s: float) -> int:
        """Whole seconds to wait: from `earliest_s` from now, or after the clients already
        told to come back, each given `per_request_s` (the cluster's time per request)."""
        now = self.clock()
        at = max(now + max(earliest_s, 0.0), self._next)
        self._next = min(at + max(per_request_s, 0.0), now + MAX_RETRY_AFTER_S)
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(at - now)))

    def room(self) -> None:
        """A request found room at once: no one need be spread after those told before."""
        self._next = min(self._next, self.clock())
