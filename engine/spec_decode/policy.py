"""How much to speculate: per request, k follows measured acceptance; per step, speculation
is switched off where the batch is large enough that it no longer pays.

Owned by the engine thread. Neither choice changes what a request generates (verification
keeps the target's distribution, and its exact text where proposals are deterministic), only
how fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# A k-th proposed token is worth scoring while the chance that it is accepted (acceptance
# rate to the k-th power, for independent acceptances) stays above this.
MIN_ACCEPT_CHANCE = 0.2
# Requests whose acceptance earns them k = 0 still try one token every this many steps,
# so a request that turns copy-like later is noticed.
PROBE_EVERY = 8
_DECAY = 0.8  # weight of the past in the acceptance estimate, per verification


@dataclass
class _Acceptance:
    accepted: float = 4.0  # prior: four of five accepted, so a new request starts at k = 7
    rejected: float = 1.0  # (capped to k_max) and needs a few rejections to come down
    skipped: int = 0

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class AdaptiveK:
    """k per request from an exponentially weighted estimate of its per-token acceptance
    rate: proposals stop at the first rejection, so a verification of k tokens that kept a
    counts a accepted and (a < k) one rejected."""

    def __init__(self, k_max: int, adaptive: bool = True) -> None:
        self.k_max = k_max
        self.adaptive = adaptive
        self._stats: dict[str, _Acceptance] = {}

    def num_tokens(self, request_id: str) -> int:
        if not self.adaptive:
            return self.k_max
        stats = self._stats.get(request_id)
        if stats is None:
            return self.k_max
        rate = stats.rate
        k = self.k_max if rate >= 1.0 else int(math.log(MIN_ACCEPT_CHANCE) / math.log(rate))
        k = max(0, min(k, self.k_max))
        if k == 0:
            stats.skipped += 1
            if stats.skipped >= PROBE_EVERY:
                stats.skipped = 0
                return 1
        return k

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        stats = self._stats.setdefault(request_id, _Acceptance())
        stats.accepted = _DECAY * stats.accepted + num_accepted
        stats.rejected = _DECAY * stats.rejected + (1 if num_accepted < num_proposed else 0)

    def retain(self, request_ids: set[str]) -> None:
        for rid in [r for r in self._stats if r not in request_ids]:
            del self._stats[rid]


@dataclass
class _Range:
    """What one batch-size range has measured. The gain of speculating is kept as an average
    of log(tokens/s with) - log(tokens/s without) over paired samples."""

    speculate: bool = True  # the current choice
    # Decayed sums over the latest steps made with the current choice (the pair's baseline).
    tokens: float = 0.0
    seconds: float = 0.0
    # The exploration burst under way: steps still to take, and what the taken ones made.
    burst_left: int = 0
    burst_tokens: float = 0.0
    burst_seconds: float = 0.0
    since_burst: int = 0
    log_gain: float = 0.0
    samples: int = 0


class BatchGate:
    """Whether a step with `n` decoding requests speculates. Off above `max_batch_size`
    (0: no fixed limit). With `adaptive`, each batch-size range (1, 2-3, 4-7, 8-15, ...)
    measures whether speculation pays: now and then a short burst of steps goes the other
    way, and its output tokens per second against the steps just before it is one paired
    sample of the gain. Pairing steps close in time keeps the comparison fair while the
    machine's speed drifts (other load, growing contexts); bursts of several steps and sums
    rather than per-step rates keep a verification's all-or-nothing acceptance from biasing
    it. Bursts are frequent while the gain is unknown or small, rare once it is clear, and
    `margin` keeps the choice from flapping on noise."""

    def __init__(self, max_batch_size: int = 0, adaptive: bool = True, min_samples: int = 3,
                 burst: int = 2, explore_every: int = 16, confident_every: int = 64,
                 confident_log_gain: float = 0.3, margin: float = 0.05,
                 decay: float = 0.7) -> None:
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.min_samples = min_samples
        self.burst = burst
        self.explore_every = explore_every
        self.confident_every = confident_every
        self.confident_log_gain = confident_log_gain
        self.margin = margin
        self.decay = decay
        self._ranges: dict[int, _Range] = {}

    @staticmethod
    def bucket(n: int) -> int:
        return n.bit_length()

    def _interval(self, r: _Range) -> int:
        if r.samples < self.min_samples:
            return 2 * self.burst
        if abs(r.log_gain) >= self.confident_log_gain:
            return self.confident_every
        return self.explore_every

    def allow(self, n: int) -> bool:
        if n <= 0 or (self.max_batch_size and n > self.max_batch_size):
            return False
        if not self.adaptive:
            return True
        r = self._ranges.setdefault(self.bucket(n), _Range())
        if r.burst_left > 0:
            r.burst_left -= 1
            return not r.speculate
        r.since_burst += 1
        if r.seconds > 0 and r.since_burst > self._interval(r):
            r.since_burst = 0
            r.burst_left = self.burst - 1
            r.burst_tokens = r.burst_seconds = 0.0
            return not r.speculate
        return r.speculate

    def observe(self, n: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A pure decode step of `n` requests produced `num_tokens` in `seconds`."""
        if not self.adaptive or n <= 0 or seconds <= 0:
            return
        r = self._ranges.get(self.bucket(n))
        if r is None:
            return
        if speculated == r.speculate:
            r.tokens = self.decay * r.tokens + num_tokens
            r.seconds = self.decay * r.seconds + seconds
            return
        r.burst_tokens += num_tokens
        r.burst_seconds += seconds
        if r.burst_left > 0 or r.seconds <= 0 or r.burst_tokens <= 0 or r.tokens <= 0:
            return
        ratio = (r.burst_tokens / r.burst_seconds) / (r.tokens / r.seconds)
        gain = math.log(ratio) * (1 if speculated else -1)
        r.log_gain = gain if r.samples == 0 else 0.75 * r.log_gain + 0.25 * gain
        r.samples += 1
        flip = r.log_gain < -self.margin if r.speculate else r.log_gain > self.margin
        if flip and r.samples >= self.min_samples:
            r.speculate = not r.speculate
            # The burst just measured was made with the new choice: it is the new baseline.
            r.tokens, r.seconds = r.burst_tokens, r.burst_seconds

    def snapshot(self) -> dict[str, float]:
        """Measured speedup of speculating per batch range (exp of the mean log gain)."""
        return {f"{1 << (b - 1)}+": round(math.exp(r.log_gain), 3)
                for b, r in sorted(self._ranges.items()) if r.samples}
