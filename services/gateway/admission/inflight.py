"""The requests this gateway released to the workers and that have not ended, and when they
will end: what a queued request waits for. Owned by the gateway's event loop.

A request ends after its remaining output tokens at the cluster's current time per token. Its
remaining tokens are judged against the output length requests have been ending at (capped by
its max_tokens): a client's max_tokens is an upper bound that chat traffic rarely reaches, and
with ignore_eos the learned length is max_tokens itself. Requests released together (a
burst into free slots) end together, so the k-th earliest end, not an average rate, says when
the k-th queued request gets a slot.
"""

from __future__ import annotations

import heapq
import time
from typing import Protocol

_ALPHA = 0.05  # per token interval or finished request: many of each go into either figure


class Released(Protocol):
    slots: int
    output_tokens: int  # all choices together
    first_token_at: float | None

    @property
    def max_output_tokens(self) -> int: ...


class InFlight:
    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._requests: set[Released] = set()
        self._last_token_at: dict[int, float] = {}  # id(request) -> when its last tokens came
        self.time_per_token_s: float | None = None  # between one choice's tokens, any load
        self.output_tokens: float | None = None  # per choice, at the end

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request: Released) -> None:
        self._requests.add(request)

    def tokens(self, request: Released, count: int) -> None:
        """`count` tokens of `request` arrived now."""
        now = self._clock()
        last = self._last_token_at.get(id(request))
        if last is not None and count:
            # A request's choices stream side by side: each of its tokens stands for one
            # interval of a choice in `slots`.
            self.time_per_token_s = _ewma(self.time_per_token_s,
                                          (now - last) * request.slots / count)
        self._last_token_at[id(request)] = now

    def remove(self, request: Released) -> None:
        if request in self._requests:
            self._requests.discard(request)
            self._last_token_at.pop(id(request), None)
            if request.first_token_at is not None:
                self.output_tokens = _ewma(self.output_tokens,
                                           request.output_tokens / request.slots)

    def nth_end_s(self, n: int, service_s: float) -> float | None:
        """Seconds until the n-th (from 0) of these requests ends; `service_s` is what one
        without a first token still needs for it. None before a time per token was measured
        or when fewer than n + 1 are in flight."""
        if self.time_per_token_s is None or n >= len(self._requests):
            return None
        ends = (self._remaining_s(r, service_s) for r in self._requests)
        return heapq.nsmallest(n + 1, ends)[-1]

    def _remaining_s(self, request: Released, service_s: float) -> float:
        per_choice = request.max_output_tokens / request.slots
        expected = min(per_choice, self.output_tokens or per_choice)
        done = request.output_tokens / request.slots
        remaining = max(1.0, expected - done) * self.time_per_token_s
        return remaining + (service_s if request.first_token_at is None else 0.0)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _ALPHA) * old + _ALPHA * sample
