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
    """What one batch-size range has measured: the gain of speculating, as an average of
    log(tokens/s with) - log(tokens/s without) over paired samples."""

    speculate: bool = True  # the current choice
    recent_rate: float | None = None  # tokens/s of the latest steps made with the choice
    log_gain: float = 0.0
    samples: int = 0
    ticks: int = 0


class BatchGate:
    """Whether a step with `n` decoding requests speculates. Off above `max_batch_size`
    (0: no fixed limit). With `adaptive`, each batch-size range (1, 2-3, 4-7, 8-15, ...)
    measures whether speculation pays: every `explore_every` steps one step goes the other
    way, and its output tokens per second, against the steps just before it, is a paired
    sample of the gain. Pairing steps that are close in time keeps the comparison fair when
    the machine's speed drifts (other load, longer contexts); `margin` keeps the choice
    from flapping on noise."""

    def __init__(self, max_batch_size: int = 0, adaptive: bool = True, min_samples: int = 4,
                 explore_every: int = 16, margin: float = 0.05, decay: float = 0.8) -> None:
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.min_samples = min_samples
        self.explore_every = explore_every
        self.margin = margin
        self.decay = decay
        self._ranges: dict[int, _Range] = {}

    @staticmethod
    def bucket(n: int) -> int:
        return n.bit_length()

    def allow(self, n: int) -> bool:
        if n <= 0 or (self.max_batch_size and n > self.max_batch_size):
            return False
        if not self.adaptive:
            return True
        r = self._ranges.setdefault(self.bucket(n), _Range())
        r.ticks += 1
        # Sample quickly at first (every other step), then every explore_every steps.
        every = 2 if r.samples < self.min_samples else self.explore_every
        explore = r.recent_rate is not None and r.ticks % every == 0
        return r.speculate != explore

    def observe(self, n: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A pure decode step of `n` requests produced `num_tokens` in `seconds`."""
        if not self.adaptive or n <= 0 or seconds <= 0 or num_tokens <= 0:
            return
        r = self._ranges.get(self.bucket(n))
        if r is None:
            return
        rate = num_tokens / seconds
        if speculated == r.speculate:
            r.recent_rate = rate if r.recent_rate is None else 0.5 * r.recent_rate + 0.5 * rate
            return
        if r.recent_rate is None:
            return
        gain = math.log(rate / r.recent_rate) * (1 if speculated else -1)
        r.log_gain = gain if r.samples == 0 else self.decay * r.log_gain + (1 - self.decay) * gain
        r.samples += 1
        flip = r.log_gain < -self.margin if r.speculate else r.log_gain > self.margin
        if flip and r.samples >= self.min_samples:
            r.speculate = not r.speculate
            r.recent_rate = rate  # the step just measured was made with the new choice

    def snapshot(self) -> dict[str, float]:
        """Measured speedup of speculating per batch range (exp of the mean log gain)."""
        return {f"{1 << (b - 1)}+": round(math.exp(r.log_gain), 3)
                for b, r in sorted(self._ranges.items()) if r.samples}
