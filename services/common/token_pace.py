"""The pace a worker's running streams get: the mean gap between its steps over a short
window, counted only while it held running requests, and the mean running requests over those
steps. It is what a stream sees as its time per output token (TPOT): the step itself, prompt
chunks mixed into it, and any pause for a co-located prefill worker (the core share). Workers
report it in their Health stats (`token_interval_s`, `interval_rows`), and the gateway holds
back new requests from a decode worker whose streams fall behind its TPOT target
(services/gateway/admission/capacity.py). Written by the engine thread, read by the server's
threads at any time, hence the lock.
"""

from __future__ import annotations

import threading
from collections import deque

WINDOW_S = 3.0  # a few of the gateway's 1 s polls: recent enough to follow the load


class TokenPace:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._gaps: deque[tuple[float, float, int]] = deque()  # (end, gap seconds, rows)
        self._gap_sum = 0.0  # of the gaps in the window, kept as they come and go: a
        self._row_sum = 0  # snapshot each step costs O(1), not a pass over the window
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
                self._row_sum += rows
            self._last_end = now if still_running else None
            self._trim(now)

    def snapshot(self, now: float) -> dict[str, float]:
        with self._lock:
            self._trim(now)
            n = len(self._gaps)
            if not n:
                return {"token_interval_s": 0.0, "interval_rows": 0.0}
            return {"token_interval_s": self._gap_sum / n, "interval_rows": self._row_sum / n}

    def _trim(self, now: float) -> None:
        while self._gaps and self._gaps[0][0] < now - self.window_s:
            _, gap, rows = self._gaps.popleft()
            self._gap_sum -= gap
            self._row_sum -= rows
        if not self._gaps:
            self._gap_sum = 0.0  # no rounding left over from the sums
