"""The Retry-After of a capacity refusal (503): when the refused client should come back.

No sooner than the earliest its request could be on time (how far the predicted time to first
token overshoots its budget: the backlog ahead drains that long), and after the clients refused
before it, each given the cluster's time per request: a burst's refusals come back spread at
the rate the cluster serves instead of all together a second later, to be refused again. (The
OpenAI SDK honours Retry-After up to 60 s and retries twice by default: with every refusal of a
48-request burst told "1", 17 clients spent both retries in under 3 s while the burst took 17 s
to serve, and raised InternalServerError.) Owned by the gateway's event loop.
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
        self._next = at + max(per_request_s, 0.0)
        return min(MAX_RETRY_AFTER_S, max(1, math.ceil(at - now)))
