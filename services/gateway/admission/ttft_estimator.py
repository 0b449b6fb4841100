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

A request for n choices sends n sequences to the workers behind one prompt, and each one costs
a first step of its own (its KV, its sampling, its grammar) that no prompt token accounts for:
13 requests of n=8 under a regex, 104 sequences at once, took 1.0-1.2 s to their first tokens
with 24-315 prompt tokens to prefill. The line knows prompt tokens only, so those first tokens
are a second term's to explain: seconds per extra choice (choices beyond each request's first,
among the requests prefilling, its own included), fitted on what the line leaves unexplained.
Taught to the line, they made its slope 2 ms per token, and the next chats behind a
1,132-token system prompt were predicted 2.25 s and refused (served in 0.32 s).

Every learned level fades towards fresher evidence: after a quiet spell a new sample outweighs
the old fit (half-life `half_life_s`), and old errors leave the margin after `error_window_s`.
The cost of a prompt token does not: moments that lost their spread keep the last fitted slope.
An idle cluster (nothing in flight, nothing queued) is never predicted late: there is nothing
to wait behind, and its first token re-teaches the fit whatever a burst taught it. Nothing
learned under a burst can keep refusing once the burst is over.

And the estimate learns its own error: the 95th percentile of (actual - predicted) over recent
events is added, so that at most about one admitted request in twenty misses a target the
plain estimate would have promised. An event is the errors that come together (within
_SAME_EVENT_S of one another), counted once at the worst of them: a burst's first tokens come
in one decode step, and its misses are one misprediction, not thirty. Counted one by one, the
ten misses of a burst of 104 short requests (0.6-0.7 s each, the line fitted on bursts of 32)
were the 95th percentile of the errors of the last 20 s and pinned the margin at its cap; the
next burst, 3 s later on an idle cluster, had 102 of 104 refused.
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
class _Event:
    """Errors that came together: when the first and the last came, and the worst of them
    (actual - predicted)."""

    first: float
    last: float
    worst: float


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
        # Exponentially weighted moments of (x = prompt tokens to prefill before the first
        # token, y = release -> first token seconds): E[x], E[y], E[x^2], E[xy].
        self._moments = [_Aged() for _ in range(4)]
        self._fit_samples = 0  # first tokens the line was fitted on
        # The last slope fitted, kept when the moments lose their spread (see _line).
        self._slope: float | None = None
        self._seen = _Loads()  # the prompt loads the line was fitted on
        # Exponentially weighted moments of (s = extra choices prefilling, r = y - the line's
        # value): E[rs], E[s^2]; their ratio is the seconds one extra choice adds.
        self._choice_moments = [_Aged(), _Aged()]
        self._seen_choices = _Loads()  # the extra-choice loads that term was fitted on
        self.duration_s: float | None = None  # release -> end
        self._errors: deque[_Event] = deque(maxlen=200)  # recent events, oldest first
        self._busy_since: float | None = None
        self._window = _Window()
        # The backlog now, since it began (None: no request waiting): what it released, for
        # judging a stall while it lasts.
        self._spell_since: float | None = None
        self._spell = _Window()

    def backlog(self, waiting: bool) -> None:
        """Whether requests are waiting; call when that may have changed."""
        now = self._clock()
        if waiting and self._busy_since is None:
            self._busy_since = self._spell_since = now
            self._spell = _Window()
        elif not waiting and self._busy_since is not None:
            self._window.busy_s += now - self._busy_since
            self._busy_since = self._spell_since = None
            self._close_window()

    def released(self, prompt_tokens: int) -> None:
        """A request left the queue. Counted only during a backlog: then the cluster, not the
        arrivals, sets the pace."""
        if self._busy_since is None:
            return
        for window in (self._window, self._spell):
            window.requests += 1
            window.tokens += prompt_tokens
        now = self._clock()
        self._window.busy_s += now - self._busy_since
        self._busy_since = now
        self._close_window()

    def first_token(self, seconds: float, predicted_ttft: float | None = None,
                    actual_ttft: float | None = None, prefill_tokens: int | None = None,
                    extra_choices: int = 0) -> None:
        """A released request's first token, `seconds` after its release, when `prefill_tokens`
        prompt tokens and `extra_choices` choices beyond each request's first (its own
        included in both) were to be prefilled before it; with what its TTFT was predicted to
        be and turned out to be, when it was predicted.

        A sample with extra choices teaches the per-choice term, what the line leaves of it;
        the line only until it is trusted (traffic of n>1 alone still gets a line)."""
        now = self._clock()
        self.service_s = _ewma(self.service_s, seconds, self.alpha)
        if prefill_tokens is not None and extra_choices and self.trusted:
            residual = seconds - self.service_at(prefill_tokens)
            self._seen_choices.remember(extra_choices, self._choice_moments[0], now,
                                        self.half_life_s)
            for moment, sample in zip(self._choice_moments, (residual * extra_choices,
                                                             extra_choices ** 2), strict=True):
                moment.add(sample, _FIT_ALPHA, now, self.half_life_s)
        elif prefill_tokens is not None:
            self._fit_samples += 1
            self._seen.remember(prefill_tokens, self._moments[0], now, self.half_life_s)
            for moment, sample in zip(self._moments, (prefill_tokens, seconds, prefill_tokens ** 2,
                                                      prefill_tokens * seconds), strict=True):
                moment.add(sample, _FIT_ALPHA, now, self.half_life_s)
            if (slope := self._fitted_slope()) is not None:
                self._slope = slope
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
                 slot_free_in_s: float | None = None, extra_choices: int = 0) -> float | None:
        """Seconds to this request's first token (the plain estimate), or None before
        anything was measured. `prefilling_tokens`: prompt tokens released and still without
        a first token; `slot_free_in_s`: when the request in flight whose end lets this one
        go will end, where known (the wait is at least that); `extra_choices`: choices beyond
        each request's first among those released without a first token, its own included."""
        service = self.service_at(prefilling_tokens + prompt_tokens, extra_choices)
        if room_now and requests_ahead == 0:
            return 0.0 if slots_in_use == 0 else service  # idle: see the module docstring
        # The backlog now, if it has drained slower than usual for a whole window (a stall),
        # counts now, not when the window closes. Only the backlog now: a window still open
        # holds the busy time of earlier backlogs, and one that ended without a release (its
        # request dropped, late) left 0.8 s and no release there; read as a stall, that added
        # 1.6 s to every estimate made while the in-flight limit was reached, and refused
        # chats predicted a slot 0.05 s away, until a release in a backlog closed the window.
        busy = 0.0 if self._spell_since is None else self._clock() - self._spell_since
        stalled = busy >= self.window_s
        if requests_ahead == 0 and slot_free_in_s is not None:
            # Next in line: it goes when enough of the running requests end, and their own
            # remaining tokens say when better than a rate measured over earlier backlogs.
            # (One early backlog set that rate at 1.63 req/s and none after it was long enough
            # to update it: 0.61 s of wait on every chat that found the in-flight limit
            # reached; 17 of one run's 24 refusals had their next slot predicted within 0.1 s.)
            wait = slot_free_in_s
            if stalled:
                wait = max(wait, busy / max(self._spell.requests, 0.5))
            return wait + service
        rate, tokens_rate = self.requests_per_s, self.tokens_per_s
        if self.duration_s and slots_in_use:
            # A queued request goes when one in flight ends: the rate they end at (Little's
            # law) bounds the drain rate, which a burst of releases into free room overstates.
            ending = slots_in_use / self.duration_s
            rate = ending if rate is None else min(rate, ending)
        if rate is None:
            return None if slot_free_in_s is None else slot_free_in_s + service
        if stalled:
            if tokens_rate and self.requests_per_s:
                # Nothing released yet counts as half a request, in tokens too: half an
                # average request's. (Counted as one token, a queue held 0.6 s by the in-flight
                # limit drained "1.6 tokens/s", and a 107-token prompt ahead was 65 s of wait.)
                floor = 0.5 * tokens_rate / self.requests_per_s
                tokens_rate = min(tokens_rate, max(self._spell.tokens, floor) / busy)
            rate = min(rate, max(self._spell.requests, 0.5) / busy)
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

    def service_at(self, prefill_tokens: int, extra_choices: int = 0) -> float:
        """Release -> first token when `prefill_tokens` prompt tokens and `extra_choices` extra
        choices (its own included) are to be prefilled before it: the fitted line plus the
        per-choice term, never below 0; the plain average before any length was seen."""
        line = self._line()
        if line is None:
            return self.service_s or 0.0
        intercept, slope = line
        return max(0.0, intercept + slope * prefill_tokens
                   + self.seconds_per_extra_choice() * extra_choices)

    @property
    def trusted(self) -> bool:
        """Whether the line has seen enough first tokens (_MIN_FIT_SAMPLES) for its estimates
        to be judged: before that, an estimate's error says nothing about the fit's, and is not
        let into the margin (a fresh gateway's first burst, predicted from nothing, would pin
        the margin at its cap for the next error_window_s and refuse work served on time)."""
        return self._fit_samples >= _MIN_FIT_SAMPLES

    def trusted_at(self, prefill_tokens: int, extra_choices: int = 0) -> bool:
        """Whether an estimate for `prefill_tokens` prompt tokens to prefill is the fit's to be
        judged by: trusted, and within the loads it was fitted on (and still weighs), give or
        take a factor of _SEEN_REACH. Beyond them the line extrapolates, and its misses there
        teach the line, not the margin. A burst behind a new 1,100-token system prompt, judged
        by a line fitted on short completions, came 0.8 s later than predicted; the line
        learned the slope from those very first tokens, yet their errors pinned the margin at
        its cap for 20 s and refused 11 of the next 12 chats (served in 0.7 s once admitted).
        Below: prompts adding 44 tokens to a cached prefix, judged by a line fitted on
        1,300-5,100-token loads, came 0.3-0.4 s late and refused the next burst. The same for
        extra choices beyond those the per-choice term was fitted on (none, the first time)."""
        return (self.trusted and self._seen.cover(prefill_tokens)
                and (not extra_choices or self._seen_choices.cover(extra_choices)))

    def seconds_per_prompt_token(self) -> float:
        """The fit's slope: what one more prompt token to prefill adds to a first token."""
        line = self._line()
        return 0.0 if line is None else line[1]

    def seconds_per_extra_choice(self) -> float:
        """What one more choice beyond a request's first adds to a first token (least squares
        through the origin on what the line leaves unexplained); never negative."""
        rs, ss = (m.value for m in self._choice_moments)
        return 0.0 if not ss else max(0.0, rs / ss)

    def _line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the least-squares line; flat while the lengths seen were too
        alike for a slope, or too few (_MIN_FIT_SAMPLES). (A line through the origin would
        read a fixed cost as a cost per token: after two short prompts, a first burst of long
        ones would be refused on that guess alone. Flat, the burst is served, and teaches the
        slope.) Never negative.

        Once fitted, the slope outlives the spread: the line goes through the moments' mean.
        A quiet spell left them one load, the line went flat, and the next burst of long
        prompts was judged by one short prompt's first token, all admitted, late by seconds."""
        x, y, _, _ = (m.value for m in self._moments)
        if x is None:
            return None
        slope = self._fitted_slope()
        if slope is None:
            slope = self._slope or 0.0
        return y - slope * x, slope

    def _fitted_slope(self) -> float | None:
        """The moments' own least-squares slope (never negative), or None while the lengths
        they weigh are too alike or the first tokens too few."""
        x, y, xx, xy = (m.value for m in self._moments)
        if x is None:
            return None
        variance = xx - x * x
        if variance < _MIN_SPREAD_TOKENS ** 2 or self._fit_samples < _MIN_FIT_SAMPLES:
            return None
        return max(0.0, (xy - x * y) / variance)

    def margin(self, target_s: float) -> float:
        """What to add to a plain estimate: its recent 95th-percentile error over events, within
        half the target either way (0 until 20 events were seen in the last
        `error_window_s`)."""
        horizon = self._clock() - self.error_window_s
        while self._errors and self._errors[0].last < horizon:
            self._errors.popleft()
        if len(self._errors) < 20:
            return 0.0
        ordered = sorted(event.worst for event in self._errors)
        error = ordered[int(0.95 * (len(ordered) - 1))]
        return max(-target_s / 2, min(target_s / 2, error))

    def _error(self, now: float, error: float) -> None:
        """One request's error: part of the event of the errors just before it, if within
        _SAME_EVENT_S of the last of them and the event is not yet _LONGEST_EVENT_S long."""
        event = self._errors[-1] if self._errors else None
        if (event is not None and now - event.last <= _SAME_EVENT_S
                and now - event.first <= _LONGEST_EVENT_S):
            event.last, event.worst = now, max(event.worst, error)
        else:
            self._errors.append(_Event(now, now, error))

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
_LONGEST_EVENT_S = 0.4  # so that steady traffic's errors do not chain into one event
_MIN_SPREAD_TOKENS = 16.0  # standard deviation of x before an intercept is believed
# First tokens before a slope is believed. A fresh gateway's first few (a warm-up of a few
# short prompts) carry each request's fixed cost, which a line through them reads as a cost
# per token: 4 warm-up prompts of 32 tokens gave 2.2 ms per token where a batched prefill
# costs under 1, and refused 26 of a burst of 32 that would have been served within 1 s.
_MIN_FIT_SAMPLES = 16
# A load the fit's samples no longer weigh this much in is forgotten (about 15 samples on, or
# a few half-lives of quiet); estimates within _SEEN_REACH times the loads remembered are
# judged.
_SEEN_WEIGHT = 0.02
_SEEN_REACH = 1.25


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

    def cover(self, load: float) -> bool:
        """Within _SEEN_REACH times the loads remembered."""
        loads = [x for x, _ in self._weighed]
        return bool(loads) and min(loads) / _SEEN_REACH <= load <= _SEEN_REACH * max(loads)


def _keep(alpha: float, age_s: float, half_life_s: float) -> float:
    """An average's weight against a new sample that comes `age_s` after its last one."""
    return (1 - alpha) * _fade(age_s, half_life_s)


def _fade(age_s: float, half_life_s: float) -> float:
    return 0.5 ** (max(0.0, age_s) / half_life_s) if half_life_s > 0 else 1.0


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else (1 - alpha) * old + alpha * sample


def _blend(old: float | None, sample: float, keep: float) -> float:
    return sample if old is None else keep * old + (1 - keep) * sample
