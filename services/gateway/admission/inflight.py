"""The requests this gateway released to the workers and that have not ended, and when they
will end: what a queued request waits for. Owned by the gateway's event loop.

A request ends after its remaining output tokens at the cluster's current time per token. Its
remaining tokens are judged by how requests have been ending: the share that ran to their
max_tokens (with ignore_eos, or a completion cut at its limit, all of them) ends at its own
max_tokens; the rest at the output length those have been stopping at (capped by its
max_tokens), since a client's max_tokens is an upper bound that chat traffic rarely reaches.
(Judged all by the average length, a request asking for 250 tokens beside ones asking for 40
was "1 token from its end" once past the average, and a queued request was told its slot came
in 0.03 s.) Requests released together (a burst into free slots) end together, so the k-th
earliest end, not an average rate, says when the k-th queued request gets a slot.
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
        # Per choice, at the end, of the requests that stopped before their max_tokens.
        self.output_tokens: float | None = None
        self.to_limit: float | None = None  # the share of requests that ran to max_tokens

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
                at_limit = request.output_tokens >= request.max_output_tokens
                self.to_limit = _ewma(self.to_limit, 1.0 if at_limit else 0.0)
                if not at_limit:
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
        stopping = min(per_choice, self.output_tokens or per_choice)
        done = request.output_tokens / request.slots
        to_limit = self.to_limit or 0.0
        tokens = to_limit * (per_choice - done) + (1 - to_limit) * max(1.0, stopping - done)
        remaining = max(1.0, tokens) * self.time_per_token_s
        return remaining + (service_s if request.first_token_at is None else 0.0)


def _ewma(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _ALPHA) * old + _ALPHA * sample
