"""Predicts a request's time to first token before it is queued, so that one which cannot meet
the TTFT target is rejected at once instead of after waiting. Owned by the event loop.

TTFT = wait in the fair queue + service (release -> first token). The wait is the backlog ahead
of the request divided by the rate the cluster takes work, measured only while requests are
waiting (otherwise the release rate is the arrival rate, not the capacity); it is measured in
requests and in prompt tokens, and the slower of the two governs, so the estimate holds
whether decode slots or prefill compute is the bottleneck. The wait is never taken below the
time until enough requests in flight end (admission/inflight.py), which also covers a
backlog that began a moment ago, before any drain rate was measured. The drain rate is never taken
above the rate requests in flight end at, by Little's law (slots in use over the average
request duration): a queued request goes when one ends, and releases into room that was free
(the start of a backlog) would overstate it.

The service time is a line in the prompt tokens that must be prefilled before the request's
first token: those of requests released and still without a first token, plus its own. Its
intercept and slope are a least-squares fit over released requests, from exponentially
weighted moments. So it grows with the prefill backlog as soon as requests are released, before
their slow first tokens are seen (a flood admitted on yesterday's quiet figure would all be
late), and a short prompt is not judged by long prompts' first tokens.

Each sequence prefilling costs a first step of its own (its KV on the decode worker, its
sampling, its grammar, the gateway's and gRPC's work for it) that no prompt token accounts
for, and a request for n choices is n sequences behind one prompt. 104 requests of 8-25
prompt tokens each, sent at once, took 0.83 s to their first tokens where bursts of 32 such had
taken 0.16 s at the same prompt-token loads (90-260 tokens prefilling); 13 requests of n=8
under a regex, 104 sequences, took 1.0-1.2 s with 24-315 tokens to prefill. The line knows
prompt tokens only, so those first tokens are a second term's to explain: seconds per extra
sequence (the sequences prefilling beyond one, its own included: every choice of the requests
released and still without a first token, and its own choices), fitted on what the line leaves
unexplained; the line is fitted on the first tokens of sequences prefilling alone. Taught to
the line, the 104 requests set its intercept at 0.57 s, and its misses (predicted 0.15 s)
pinned the margin at its cap: a burst 3 s later, on an idle cluster, had 102 of 104 refused.
The n=8 requests, taught to the line, made its slope 2 ms per token, and the next chats behind
a 1,132-token system prompt were predicted 2.25 s and refused (served in 0.32 s).

Every learned figure fades towards fresher evidence: after a quiet spell a new sample outweighs
the old fit (half-life `half_life_s`), and old errors leave the margin after `error_window_s`.
An idle cluster (nothing in flight, nothing queued) is never predicted late: there is nothing
to wait behind, and its first token re-teaches the fit whatever a burst taught it. Nothing
learned under a burst can keep refusing once the burst is over.

And the estimate learns its own error: the 95th percentile of (actual - predicted) over recent
events is added, so that at most about one admitted request in twenty misses a target the
plain estimate would have promised. An event is the errors that come together (within
_SAME_EVENT_S of one another), counted once at the worst of them: a burst's first tokens come
in one decode step, and its misses are one misprediction, not thirty. Counted one by one, the
3 misses of 13 requests of n=8 sent at once (0.7 s each) were the 95th percentile of the 35
errors of the last 20 s and pinned the margin at its cap; the next burst, on an idle cluster,
had 12 of 13 refused.
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
            self.value = _blend(self.value, sample, _keep(alpha, now - self.at, half_life_s))
        self.at = now


class TTFTEstimator:
    def __init__(self, window_s: float = 0.5, alpha: float = 0.3, clock=time.monotonic,
                 half_life_s: float = 3.0, error_window_s: float = 20.0) -> None:
        self.window_s = window_s
        self.alpha = alpha
        self.half_life_s = half_life_s
        self.error_window_s = error_window_s
        self._clock = clock
        self.requests_per_s: float | None = None  # drain rate while backlogged
        self.tokens_per_s: float | None = None
        self._rate_at = 0.0
        self.service_s: float | None = None  # release -> first token, any load
        # Lines in (x = prompt tokens to prefill before the first token, y = release -> first
        # token seconds): over every first token (until trusted; then those alone), and over
        # those of sequences prefilled alone.
        self._every = _Fit(_MIN_FIT_SAMPLES)
        self._alone = _Fit(_MIN_ALONE_SAMPLES)
        # Exponentially weighted moments of (s = extra sequences prefilling, r = y - the line's
        # value): E[rs], E[s^2]; their ratio is the seconds one extra sequence adds.
        self._sequence_moments = [_Aged(), _Aged()]
        self._seen_sequences = _Loads()  # the extra-sequence loads that term was fitted on
        self.duration_s: float | None = None  # release -> end
        # Recent events: [first, last error's time, the worst actual - predicted among them].
        self._errors: deque[list[float]] = deque(maxlen=200)
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
                    actual_ttft: float | None = None, prefill_tokens: int | None = None,
                    extra_sequences: int = 0) -> None:
        """A released request's first token, `seconds` after its release, when `prefill_tokens`
        prompt tokens and `extra_sequences` sequences beyond one (its own included in both)
        were to be prefilled before it; with what its TTFT was predicted to be and turned out
        to be, when it was predicted.

        The line is fitted on the first tokens of sequences prefilled alone, once the estimate
        is trusted and there are some; a sample with extra sequences then teaches the
        per-sequence term what that line leaves of it. Until then, and for traffic that never
        prefills one sequence alone (bursts, n>1 only), the line is over every first token
        until trusted and over those alone since: a set of 13 n=8 requests, first tokens at
        up to 4 s the first time (grammars and tokenizers cold), taught to it, had the chats
        after them behind a new system prompt predicted 5.3 s and 11 of 12 refused.
        (The line over every first token of a warm-up burst reads its first request, stepped
        alone in 0.08 s, against the rest, stepped together in 0.17 s, as 1.5 ms per prompt
        token; the 12 chats behind a 506-token system prompt were then predicted 0.79 s and
        came in 0.36 s.)"""
        now = self._clock()
        self.service_s = _ewma(self.service_s, seconds, self.alpha)
        if prefill_tokens is None:
            pass
        elif extra_sequences and self.trusted:
            line = self._line_at(prefill_tokens, extra_sequences)
            residual = seconds - (line if line is not None else self.service_s)
            self._seen_sequences.remember(extra_sequences, self._sequence_moments[0], now,
                                          self.half_life_s)
            for moment, sample in zip(self._sequence_moments, (residual * extra_sequences,
                                                               extra_sequences ** 2), strict=True):
                moment.add(sample, _FIT_ALPHA, now, self.half_life_s)
        else:
            if not extra_sequences:
                self._alone.add(prefill_tokens, seconds, now, self.half_life_s)
            self._every.add(prefill_tokens, seconds, now, self.half_life_s)
        if predicted_ttft is not None and actual_ttft is not None:
            self._error(now, actual_ttft - predicted_ttft)

    def missed(self, predicted_ttft: float | None, at_least: float) -> None:
        """A request dropped from the queue, late: its TTFT would have been `at_least`."""
        if predicted_ttft is not None:
            self._error(self._clock(), at_least - predicted_ttft)

    def finished(self, seconds: float) -> None:
        """A released request ended, `seconds` after its release."""
        self.duration_s = _ewma(self.duration_s, seconds, self.alpha)

    def estimate(self, requests_ahead: int, tokens_ahead: int, prompt_tokens: int,
                 room_now: bool, slots_in_use: int = 0, prefilling_tokens: int = 0,
                 slot_free_in_s: float | None = None, extra_sequences: int = 0) -> float | None:
        """Seconds to this request's first token (the plain estimate), or None before
        anything was measured. `prefilling_tokens`: prompt tokens released and still without
        a first token; `slot_free_in_s`: when the request in flight whose end lets this one
        go will end, where known (the wait is at least that); `extra_sequences`: sequences beyond
        one among those released without a first token and its own (every choice of each)."""
        service = self.service_at(prefilling_tokens + prompt_tokens, extra_sequences)
        if room_now and requests_ahead == 0:
            return 0.0 if slots_in_use == 0 else service  # idle: see the module docstring
        rate, tokens_rate = self.requests_per_s, self.tokens_per_s
        if self.duration_s and slots_in_use:
            # A queued request goes when one in flight ends: the rate they end at (Little's
            # law) bounds the drain rate, which a burst of releases into free room overstates.
            ending = slots_in_use / self.duration_s
            rate = ending if rate is None else min(rate, ending)
        if rate is None:
            return None if slot_free_in_s is None else slot_free_in_s + service
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
        if slot_free_in_s is not None:
            wait = max(wait, slot_free_in_s)
        return wait + service

    def service_at(self, prefill_tokens: int, extra_sequences: int = 0) -> float:
        """Release -> first token when `prefill_tokens` prompt tokens and `extra_sequences`
        sequences beyond one (its own included) are to be prefilled before it: the fitted line
        plus the per-sequence term, never below 0; the plain average before any length was
        seen."""
        line = self._line_at(prefill_tokens, extra_sequences)
        if line is None:
            return self.service_s or 0.0
        return max(0.0, line + self.seconds_per_extra_sequence() * extra_sequences)

    @property
    def trusted(self) -> bool:
        """Whether the line has seen enough first tokens (_MIN_FIT_SAMPLES) for its estimates
        to be judged: before that, an estimate's error says nothing about the fit's, and is not
        let into the margin (a fresh gateway's first burst, predicted from nothing, would pin
        the margin at its cap for the next error_window_s and refuse work served on time)."""
        return self._every.samples >= _MIN_FIT_SAMPLES

    def trusted_at(self, prefill_tokens: int, extra_sequences: int = 0) -> bool:
        """Whether an estimate for `prefill_tokens` prompt tokens to prefill is the fit's to be
        judged by: trusted, and within the loads it was fitted on (and still weighs), give or
        take a factor of _SEEN_REACH. Beyond them the line extrapolates, and its misses there
        teach the line, not the margin. A burst behind a new 1,100-token system prompt, judged
        by a line fitted on short completions, came 0.8 s later than predicted; the line
        learned the slope from those very first tokens, yet their errors pinned the margin at
        its cap for 20 s and refused 11 of the next 12 chats (served in 0.7 s once admitted).
        Below: prompts adding 44 tokens to a cached prefix, judged by a line fitted on
        1,300-5,100-token loads, came 0.3-0.4 s late and refused the next burst. The same for
        extra sequences beyond those the per-sequence term was fitted on (none, the first
        time): 104 short requests at once came 0.7 s later than a fit on bursts of 32
        predicted (the same prompt-token loads, a third of the sequences)."""
        return (self.trusted and self._fit().seen.cover(prefill_tokens)
                and (not extra_sequences
                     or self._seen_sequences.cover(extra_sequences, through_origin=True)))

    def seconds_per_prompt_token(self) -> float:
        """The fit's slope: what one more prompt token to prefill adds to a first token."""
        line = self._line()
        return 0.0 if line is None else line[1]

    def seconds_per_extra_sequence(self) -> float:
        """What one more sequence prefilling adds to a first token (least squares
        through the origin on what the line leaves unexplained); never negative."""
        rs, ss = (m.value for m in self._sequence_moments)
        return 0.0 if not ss else max(0.0, rs / ss)

    def _line(self) -> tuple[float, float] | None:
        return self._fit().line()

    def _fit(self) -> _Fit:
        """The line in use: over sequences prefilled alone once trusted and there are some
        (see first_token), else over every first token."""
        return self._alone if self.trusted and self._alone.samples else self._every

    def _line_at(self, prefill_tokens: int, extra_sequences: int) -> float | None:
        """The line in use at `prefill_tokens`. Where that is the line over sequences prefilled
        alone and flat (lengths too alike for a slope), the tokens beyond what the sequences
        would hold at the longest length it saw (by _SEEN_REACH) each cost what the line over
        every first token says: lone chats of 6-37 tokens give no slope, and judged by them
        alone 8 prompts of 2,000 tokens sent at once would all be admitted, the last ~4 s late.
        (That line is steeper than a prefill's cost per token, since it reads a burst's
        batching as one, so it stands in only for prompts longer than any seen alone; a burst
        of many short ones is the per-sequence term's.)"""
        fit = self._fit()
        line = fit.line()
        if line is None:
            return None
        intercept, slope = line
        if fit is self._alone and slope == 0.0:
            beyond = prefill_tokens - (extra_sequences + 1) * fit.seen.longest() * _SEEN_REACH
            every = self._every.line()
            if beyond > 0 and every is not None:
                return intercept + every[1] * beyond
        return intercept + slope * prefill_tokens

    def margin(self, target_s: float) -> float:
        """What to add to a plain estimate: its recent 95th-percentile error over events, within
        half the target either way (0 until 20 events were seen in the last
        `error_window_s`)."""
        horizon = self._clock() - self.error_window_s
        while self._errors and self._errors[0][1] < horizon:
            self._errors.popleft()
        if len(self._errors) < 20:
            return 0.0
        ordered = sorted(error for _, _, error in self._errors)
        error = ordered[int(0.95 * (len(ordered) - 1))]
        return max(-target_s / 2, min(target_s / 2, error))

    def _error(self, now: float, error: float) -> None:
        """One request's error: part of the event of the errors just before it, if within
        _SAME_EVENT_S of the last of them (an event at most _SAME_EVENT_S * 20 long)."""
        last = self._errors[-1] if self._errors else None
        if (last is not None and now - last[1] <= _SAME_EVENT_S
                and now - last[0] <= 20 * _SAME_EVENT_S):
            last[1], last[2] = now, max(last[2], error)
        else:
            self._errors.append([now, now, error])

    def _close_window(self) -> None:
        window = self._window
        if window.busy_s < self.window_s or window.requests == 0:
            return
        now = self._clock()
        keep = _keep(self.alpha, now - self._rate_at, self.half_life_s)
        self.requests_per_s = _blend(self.requests_per_s, window.requests / window.busy_s, keep)
        self.tokens_per_s = _blend(self.tokens_per_s, window.tokens / window.busy_s, keep)
        self._rate_at = now
        self._window = _Window()


_FIT_ALPHA = 0.1  # a slope needs many requests' worth of evidence
# Errors this close together are one event for the margin: a decode step's first tokens reach
# the gateway within ~15 ms of one another here (30 streams), and steps are 30-80 ms apart.
_SAME_EVENT_S = 0.02
_MIN_SPREAD_TOKENS = 16.0  # standard deviation of x before an intercept is believed
# First tokens before a slope is believed. A fresh gateway's first few (a warm-up of a few
# short prompts) carry each request's fixed cost, which a line through them reads as a cost
# per token: 4 warm-up prompts of 32 tokens gave 2.2 ms per token where a batched prefill
# costs under 1, and refused 26 of a burst of 32 that would have been served within 1 s.
_MIN_FIT_SAMPLES = 16
# Of sequences prefilled alone, fewer will do: none of them shares a step with another, so a
# slope between them is a prefill's cost per token, not a batch's per request.
_MIN_ALONE_SAMPLES = 3
# A load the fit's samples no longer weigh this much in is forgotten (about 15 samples on, or
# a few half-lives of quiet); estimates within _SEEN_REACH times the loads remembered are
# judged.
_SEEN_WEIGHT = 0.02
_SEEN_REACH = 1.25


class _Fit:
    """A least-squares line of first tokens' seconds in the prompt tokens to prefill before
    them, from exponentially weighted moments E[x], E[y], E[x^2], E[xy] (see _Aged), with the
    loads its samples came at."""

    def __init__(self, min_samples: int) -> None:
        self.min_samples = min_samples  # before a slope is believed
        self.moments = [_Aged() for _ in range(4)]
        self.samples = 0
        self.seen = _Loads()

    def add(self, tokens: int, seconds: float, now: float, half_life_s: float) -> None:
        self.samples += 1
        self.seen.remember(tokens, self.moments[0], now, half_life_s)
        for moment, sample in zip(self.moments, (tokens, seconds, tokens ** 2, tokens * seconds),
                                  strict=True):
            moment.add(sample, _FIT_ALPHA, now, half_life_s)

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope); flat while the lengths seen were too alike for a slope, or too
        few (min_samples). (A line through the origin would read a fixed cost as a cost per
        token: after two short prompts, a first burst of long ones would be refused on that
        guess alone. Flat, the burst is served, and teaches the slope.) Never negative."""
        x, y, xx, xy = (m.value for m in self.moments)
        if x is None:
            return None
        variance = xx - x * x
        if variance < _MIN_SPREAD_TOKENS ** 2 or self.samples < self.min_samples:
            return y, 0.0
        slope = max(0.0, (xy - x * y) / variance)
        return y - slope * x, slope


class _Loads:
    """The loads a fit's samples came at, weighed as its moments weigh them (see _Aged.add),
    as far as they still weigh at least _SEEN_WEIGHT."""

    def __init__(self) -> None:
        self._weighed: list[list[float]] = []  # [load, weight]

    def remember(self, load: float, moment: _Aged, now: float, half_life_s: float) -> None:
        """A sample at `load`, about to be added to `moment` (any of the fit's moments)."""
        keep = 0.0 if moment.value is None else _keep(_FIT_ALPHA, now - moment.at, half_life_s)
        self._weighed = [[x, w * keep] for x, w in self._weighed if w * keep >= _SEEN_WEIGHT]
        self._weighed.append([float(load), 1.0 - keep])

    def longest(self) -> float:
        return max((x for x, _ in self._weighed), default=0.0)

    def cover(self, load: float, through_origin: bool = False) -> bool:
        """Within _SEEN_REACH times the loads remembered; for a term through the origin (no
        intercept to get wrong below them), anywhere up to _SEEN_REACH times the largest."""
        loads = [x for x, _ in self._weighed]
        lowest = 0.0 if through_origin else min(loads, default=0.0) / _SEEN_REACH
        return bool(loads) and lowest <= load <= _SEEN_REACH * max(loads)


def _keep(alpha: float, age_s: float, half_life_s: float) -> float:
    """An average's weight against a new sample that comes `age_s` after its last one."""
    return (1 - alpha) * _fade(age_s, half_life_s)


def _fade(age_s: float, half_life_s: float) -> float:
    return 0.5 ** (max(0.0, age_s) / half_life_s) if half_life_s > 0 else 1.0


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else (1 - alpha) * old + alpha * sample


def _blend(old: float | None, sample: float, keep: float) -> float:
    return sample if old is None else keep * old + (1 - keep) * sample
