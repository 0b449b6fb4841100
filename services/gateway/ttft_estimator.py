"""Predicts a request's time to first token before it is queued, so that one which cannot meet
the TTFT target is rejected at once instead of after waiting. Owned by the event loop.

TTFT = wait in the fair queue + service (release -> first token). The wait is the backlog ahead
of the request divided by the rate the cluster takes work, measured only while requests are
waiting (otherwise the release rate is the arrival rate, not the capacity); it is measured in
requests and in prompt tokens, and the slower of the two governs, so the estimate holds
whether decode slots or prefill compute is the bottleneck. The service time is an average of
what released requests took to their first token, kept per load level (requests in flight at
release, in powers of two): a burst's multi-second first tokens say nothing about a quiet
cluster, and one average over both would keep rejecting long after the burst is gone. Within a
level it is corrected for the prompt's length by the per-token cost seen across all levels, so
that long prompts' slow first tokens do not make a short prompt look late.

Every learned figure fades towards fresher evidence: a load level not measured for a while is
read as drifting towards the level below it (half-life `half_life_s`), old errors leave the
margin after `error_window_s`, and a new sample after a quiet spell outweighs the old average.
Nothing learned under a burst can keep refusing once the burst is over.

An idle cluster (nothing in flight, nothing queued) is never predicted late: there is nothing
to wait behind, and a refusal there would also stop the estimate from ever learning that the
cluster is quick again.

Before any backlog was measured, the drain rate is taken from Little's law (slots in use over
the average request duration). And the estimate learns its own error: the 95th percentile of
(actual - predicted) over recent requests is added, so that at most about one admitted request
in twenty misses a target the plain estimate would have promised.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass


@dataclass
class _Window:
    busy_s: float = 0.0
    requests: int = 0
    tokens: int = 0


@dataclass
class _Aged:
    """An exponentially weighted average whose old value counts for less the longer it went
    without a sample: after a quiet spell, one new sample mostly replaces it."""

    value: float | None = None
    at: float = 0.0

    def add(self, sample: float, alpha: float, now: float, half_life_s: float) -> None:
        if self.value is None:
            self.value = sample
        else:
            keep = (1 - alpha) * _fade(now - self.at, half_life_s)
            self.value = keep * self.value + (1 - keep) * sample
        self.at = now


@dataclass
class _Level:
    """Release -> first token at one load level, and the prompt length it was measured at."""

    service: _Aged
    prompt: _Aged


class TTFTEstimator:
    def __init__(self, window_s: float = 0.5, alpha: float = 0.3, clock=time.monotonic,
                 half_life_s: float = 10.0, error_window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.alpha = alpha
        self.half_life_s = half_life_s
        self.error_window_s = error_window_s
        self._clock = clock
        self.requests_per_s: float | None = None  # drain rate while backlogged
        self.tokens_per_s: float | None = None
        self._rate_at = 0.0
        self.service_s: float | None = None  # release -> first token, any load
        self._levels: dict[int, _Level] = {}  # the same, by _load_level(in flight)
        # Seconds of first-token time per prompt token: exponentially weighted moments of
        # (prompt tokens, service seconds) over all levels, for a least-squares slope.
        self._moments = [_Aged() for _ in range(4)]  # E[x], E[y], E[x^2], E[xy]
        self.duration_s: float | None = None  # release -> end
        self._errors: deque[tuple[float, float]] = deque(maxlen=200)  # (when, actual - predicted)
        self._busy_since: float | None = None
        self._window = _Window()

    def backlog(self, waiting: bool) -> None:
        """Whether requests are waiting; call when that may have changed."""
        now = self._clock()
        if waiting and self._busy_since is None:
            self._busy_since = now
        elif not waiting and self._busy_since is not None:
            self._window.busy_s += now - self._busy_since
            self._busy_since = None
            self._close_window()

    def released(self, prompt_tokens: int) -> None:
        """A request left the queue. Counted only during a backlog: then the cluster, not the
        arrivals, sets the pace."""
        if self._busy_since is None:
            return
        self._window.requests += 1
        self._window.tokens += prompt_tokens
        now = self._clock()
        self._window.busy_s += now - self._busy_since
        self._busy_since = now
        self._close_window()

    def first_token(self, seconds: float, predicted_ttft: float | None = None,
                    actual_ttft: float | None = None, inflight_at_release: int | None = None,
                    prompt_tokens: int | None = None) -> None:
        """A released request's first token, `seconds` after its release (into a cluster with
        `inflight_at_release` requests in flight, for a prompt of `prompt_tokens`); with what
        its TTFT was predicted to be and turned out to be, when it was predicted."""
        now = self._clock()
        self.service_s = _ewma(self.service_s, seconds, self.alpha)
        if inflight_at_release is not None:
            level = self._levels.setdefault(_load_level(inflight_at_release),
                                            _Level(_Aged(), _Aged()))
            level.service.add(seconds, self.alpha, now, self.half_life_s)
            if prompt_tokens is not None:
                level.prompt.add(prompt_tokens, self.alpha, now, self.half_life_s)
        if prompt_tokens is not None:
            for moment, sample in zip(self._moments, (prompt_tokens, seconds, prompt_tokens ** 2,
                                                      prompt_tokens * seconds), strict=True):
                moment.add(sample, _SLOPE_ALPHA, now, self.half_life_s * 6)
        if predicted_ttft is not None and actual_ttft is not None:
            self._errors.append((now, actual_ttft - predicted_ttft))

    def missed(self, predicted_ttft: float | None, at_least: float) -> None:
        """A request dropped from the queue, late: its TTFT would have been `at_least`."""
        if predicted_ttft is not None:
            self._errors.append((self._clock(), at_least - predicted_ttft))

    def finished(self, seconds: float) -> None:
        """A released request ended, `seconds` after its release."""
        self.duration_s = _ewma(self.duration_s, seconds, self.alpha)

    def estimate(self, requests_ahead: int, tokens_ahead: int, prompt_tokens: int,
                 room_now: bool, slots_in_use: int = 0) -> float | None:
        """Seconds to this request's first token (the plain estimate), or None before
        anything was measured."""
        service = self.service_at(slots_in_use, prompt_tokens)
        if room_now and requests_ahead == 0:
            return 0.0 if slots_in_use == 0 else service  # idle: see the module docstring
        rate, tokens_rate = self.requests_per_s, self.tokens_per_s
        if rate is None and self.duration_s and slots_in_use:
            rate = slots_in_use / self.duration_s
        if rate is None:
            return None
        # A backlog that has drained slower than usual for a whole window (a stall) counts
        # now, not when the window closes.
        busy = self._window.busy_s + (self._clock() - self._busy_since
                                      if self._busy_since is not None else 0.0)
        if busy >= self.window_s:
            rate = min(rate, max(self._window.requests, 0.5) / busy)
            if tokens_rate:
                tokens_rate = min(tokens_rate, max(self._window.tokens, 1) / busy)
        wait = (requests_ahead + 1) / rate
        if tokens_rate and tokens_ahead:
            # Only the prompts ahead: the rate is what was released while backlogged, so it is
            # the prefill rate only when prefill was the bottleneck; when slots were, it is the
            # backlog's own prompts per second and would make any long prompt look late.
            # The request's own prefill is part of the service time.
            wait = max(wait, tokens_ahead / tokens_rate)
        return wait + service

    def service_at(self, inflight: int, prompt_tokens: int | None = None) -> float:
        """Release -> first token with `inflight` requests in flight, for a prompt of
        `prompt_tokens` (None: of the length measured there): what was measured at that load
        level, fading with its age towards the nearest lower level measured; with no level
        below, what was measured at any load."""
        now = self._clock()
        slope = self.seconds_per_prompt_token()
        value = None
        for number in range(0, _load_level(inflight) + 1):
            level = self._levels.get(number)
            if level is None:
                continue
            own = level.service.value
            if prompt_tokens is not None and level.prompt.value is not None:
                own = max(0.0, own + slope * (prompt_tokens - level.prompt.value))
            value = own if value is None else (
                value + (own - value) * _fade(now - level.service.at, self.half_life_s))
        return (self.service_s or 0.0) if value is None else value

    def seconds_per_prompt_token(self) -> float:
        """The least-squares slope of first-token time over prompt length (0 until prompts of
        clearly different lengths were seen); never negative."""
        x, y, xx, xy = (m.value for m in self._moments)
        if x is None:
            return 0.0
        variance = xx - x * x
        if variance < _MIN_PROMPT_SPREAD ** 2:
            return 0.0
        return max(0.0, (xy - x * y) / variance)

    def margin(self, target_s: float) -> float:
        """What to add to a plain estimate: its recent 95th-percentile error, within half the
        target either way (0 until 20 requests were seen in the last `error_window_s`)."""
        horizon = self._clock() - self.error_window_s
        while self._errors and self._errors[0][0] < horizon:
            self._errors.popleft()
        if len(self._errors) < 20:
            return 0.0
        ordered = sorted(error for _, error in self._errors)
        error = ordered[int(0.95 * (len(ordered) - 1))]
        return max(-target_s / 2, min(target_s / 2, error))

    def _close_window(self) -> None:
        window = self._window
        if window.busy_s < self.window_s or window.requests == 0:
            return
        now = self._clock()
        keep = 1 - self.alpha if self.requests_per_s is None else \
            (1 - self.alpha) * _fade(now - self._rate_at, self.half_life_s)
        self.requests_per_s = _blend(self.requests_per_s, window.requests / window.busy_s, keep)
        self.tokens_per_s = _blend(self.tokens_per_s, window.tokens / window.busy_s, keep)
        self._rate_at = now
        self._window = _Window()


_SLOPE_ALPHA = 0.05  # the slope needs many prompts; it changes only with the model and machine
_MIN_PROMPT_SPREAD = 16.0  # tokens of standard deviation before a slope is believed


def _load_level(inflight: int) -> int:
    """0 for an idle cluster, then one level per power of two: 1, 2-3, 4-7, 8-15, ..."""
    return max(0, inflight).bit_length()


def _fade(age_s: float, half_life_s: float) -> float:
    return 0.5 ** (max(0.0, age_s) / half_life_s) if half_life_s > 0 else 1.0


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else (1 - alpha) * old + alpha * sample


def _blend(old: float | None, sample: float, keep: float) -> float:
    return sample if old is None else keep * old + (1 - keep) * sample
