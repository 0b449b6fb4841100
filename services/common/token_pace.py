"""The pace a worker's running streams get: over a short window, counted only while it held
running requests, the mean gap between its steps per token its streams got (a step of 100 rows
is 100 tokens' gap, a step of one row is one token's), and the mean running requests a token
shared its step with. It is what the streams see as their time per output token (TPOT): the
step itself, prompt chunks mixed into it, and any pause for a co-located prefill worker (the
core share). Workers report it in their Health stats (`token_interval_s`, `interval_rows`), and
the gateway holds back new requests from a decode worker whose streams fall behind its TPOT
target (services/gateway/admission/capacity.py). Written by the engine thread, read by the
server's threads at any time, hence the lock.

It is judged over a third of the window at least: until the gaps counted add up to that, it is
reported as nothing measured. The first step of a burst carries its first-step costs (its
grammars, its KV landing): `make run`'s decode worker, idle, took 0.281 s for a first step of 24
rows of 13 requests of n=8 under a regex, and a Health poll that saw that one step alone held
the worker to 8 requests for the next second (24 x 0.1 s target / 0.281 s), refusing 4 of 12
chats sent then; its steps after it ran ~100 rows each in 0.08-0.16 s.

Per token, not per step: a window of steps of [24, 104, 104, 104, 103, 96, 54, 42, 24, 4] rows
averages 66 rows a step but 88 a token; streams see the second.
"""

from __future__ import annotations

import threading
from collections import deque

WINDOW_S = 3.0  # a few of the gateway's 1 s polls: recent enough to follow the load
MIN_SPAN = 1 / 3  # of the window: the running time its gaps must cover to be judged


class TokenPace:
    def __init__(self, window_s: float = WINDOW_S, min_span_s: float | None = None) -> None:
        self.window_s = window_s
        self.min_span_s = MIN_SPAN * window_s if min_span_s is None else min_span_s
        self._lock = threading.Lock()
        self._gaps: deque[tuple[float, float, int]] = deque()  # (end, gap seconds, rows)
        # Over the gaps in the window, kept as they come and go (a snapshot each step costs
        # O(1), not a pass over the window): sums of gaps, rows x gap, rows, rows^2.
        self._gap_sum = 0.0
        self._token_gap_sum = 0.0
        self._row_sum = 0
        self._row_square_sum = 0
        self._last_end: float | None = None  # the previous step's end, if it left any running

    def step_done(self, now: float, rows: int, still_running: bool) -> None:
        """A step ended at `now` (time.monotonic()); `rows` requests were running when it
        began. The gap since the step before counts only if that one left requests running:
        the time after an idle spell is not a stream's."""
        with self._lock:
            if self._last_end is not None and rows:
                gap = now - self._last_end
                self._gaps.append((now, gap, rows))
                self._gap_sum += gap
                self._token_gap_sum += rows * gap
                self._row_sum += rows
                self._row_square_sum += rows * rows
            self._last_end = now if still_running else None
            self._trim(now)

    def snapshot(self, now: float) -> dict[str, float]:
        with self._lock:
            self._trim(now)
            tokens = self._row_sum
            if not tokens or self._gap_sum < self.min_span_s:
                return {"token_interval_s": 0.0, "interval_rows": 0.0}
            return {"token_interval_s": self._token_gap_sum / tokens,
                    "interval_rows": self._row_square_sum / tokens}

    def _trim(self, now: float) -> None:
        while self._gaps and self._gaps[0][0] < now - self.window_s:
            _, gap, rows = self._gaps.popleft()
            self._gap_sum -= gap
            self._token_gap_sum -= rows * gap
            self._row_sum -= rows
            self._row_square_sum -= rows * rows
        if not self._gaps:
            self._gap_sum = self._token_gap_sum = 0.0  # no rounding left over from the sums
