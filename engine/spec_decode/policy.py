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
    accepted: float = 2.0  # prior: two of three accepted, so new requests start at k_max
    rejected: float = 1.0
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
class _Arm:
    """Exponentially weighted tokens and seconds of the steps taken with one choice."""

    steps: int = 0
    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.steps += 1
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class BatchGate:
    """Whether a step with `n` decoding requests speculates. Off above `max_batch_size`
    (0: no fixed limit). With `adaptive`, each batch-size range (1, 2-3, 4-7, 8-15, ...)
    keeps the measured output tokens per second of pure decode steps with and without
    speculation and picks the better, trying the other one every `explore_every` steps so a
    change of workload is noticed."""

    def __init__(self, max_batch_size: int = 0, adaptive: bool = True, min_steps: int = 4,
                 explore_every: int = 16, decay: float = 0.9) -> None:
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.min_steps = min_steps
        self.explore_every = explore_every
        self.decay = decay
        self._arms: dict[tuple[int, bool], _Arm] = {}
        self._ticks: dict[int, int] = {}

    @staticmethod
    def bucket(n: int) -> int:
        return n.bit_length()

    def allow(self, n: int) -> bool:
        if n <= 0 or (self.max_batch_size and n > self.max_batch_size):
            return False
        if not self.adaptive:
            return True
        bucket = self.bucket(n)
        on = self._arms.get((bucket, True))
        off = self._arms.get((bucket, False))
        if on is None or on.steps < self.min_steps:
            return True
        if off is None or off.steps < self.min_steps:
            return False
        tick = self._ticks[bucket] = self._ticks.get(bucket, 0) + 1
        better = on.rate >= off.rate
        return not better if tick % self.explore_every == 0 else better

    def observe(self, n: int, speculated: bool, num_tokens: int, seconds: float) -> None:
        """A pure decode step of `n` requests produced `num_tokens` in `seconds`."""
        if not self.adaptive or n <= 0:
            return
        arm = self._arms.setdefault((self.bucket(n), speculated), _Arm())
        arm.add(num_tokens, seconds, self.decay)

    def snapshot(self) -> dict[str, float]:
        """Measured tokens/s per (range, choice), for logs and benchmarks."""
        return {f"{'on' if on else 'off'}@{1 << (b - 1)}+": arm.rate
                for (b, on), arm in sorted(self._arms.items())}
