"""Whether a decode step speculates at all: never above a fixed batch size and, measured per
batch-size range, not where speculating would lower output tokens per second.

Owned by the engine thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class _Range:
    """What one batch-size range has measured."""

    speculate: bool = True  # the current choice
    # Acceptance, exact and current: decayed sums over the latest speculating steps of the
    # requests in them, the tokens they produced and the tokens they had proposed.
    on_requests: float = 0.0
    on_tokens: float = 0.0
    on_proposed: float = 0.0
    on_steps: int = 0  # speculating steps seen, undecayed
    # Cost, from timing: extra step time per proposed token per request, relative to a plain
    # step (a local linear model of the forward's cost in its number of query tokens).
    cost: float = 0.0
    cost_samples: int = 0
    # Paired timing: decayed (seconds, steps, proposed per request) of the latest steps made
    # with the current choice, and the same for the exploration burst under way.
    base: tuple[float, float, float] = (0.0, 0.0, 0.0)
    burst: tuple[float, float, float] = (0.0, 0.0, 0.0)
    burst_left: int = 0
    since_burst: int = 0
    last_step: int = -2  # the gate's step count when this range last ran

    def gain(self) -> float:
        """Expected output tokens/s with speculation over without."""
        if not self.on_requests:
            return 1.0
        tokens = self.on_tokens / self.on_requests  # per request per step; 1 without
        proposed = self.on_proposed / self.on_requests
        return tokens / (1.0 + max(self.cost, 0.0) * proposed)

    def free_gain(self) -> float:
        """The gain if speculating cost nothing: what acceptance alone allows."""
        return self.on_tokens / self.on_requests if self.on_requests else 1.0


class BatchGate:
    """Whether a step with `n` decoding requests speculates. Off above `max_batch_size`
    (0: no fixed limit). With `adaptive`, each batch-size range (1, 2-3, 4-7, 8-15, ...)
    estimates the gain of speculating as tokens per request per step (from acceptance,
    exact and current) over the step's relative cost (1 + cost x proposed tokens per
    request), and speculates while the gain exceeds 1 (with `margin` against flapping).

    The cost comes from timing: now and then a burst of `burst` steps goes the other way, and
    its time per step against the steps just before it is one paired sample. Pairing steps
    close in time keeps the comparison fair while the machine's speed drifts; the cost
    depends on the hardware and the batch, not on the text, so it is averaged over many
    samples while a change of workload (acceptance) shows at once. Bursts are frequent while
    the cost is unknown or the gain close to 1, and rare once the answer is clear."""

    def __init__(self, max_batch_size: int = 0, adaptive: bool = True, min_samples: int = 3,
                 burst: int = 2, explore_every: int = 16, confident_every: int = 48,
                 confident_log_gain: float = 0.4, margin: float = 0.05,
                 decay: float = 0.7, acceptance_decay: float = 0.9,
                 cost_weight: float = 0.25) -> None:
        self.max_batch_size = max_batch_size
        self.adaptive = adaptive
        self.min_samples = min_samples
        self.burst_steps = burst
        self.explore_every = explore_every
        self.confident_every = confident_every
        self.confident_log_gain = confident_log_gain
        self.margin = margin
        self.decay = decay
        self.acceptance_decay = acceptance_decay
        self.cost_weight = cost_weight
        self._ranges: dict[int, _Range] = {}
        self._steps = 0

    @staticmethod
    def bucket(n: int) -> int:
        return n.bit_length()

    def _interval(self, r: _Range) -> int:
        if r.cost_samples < self.min_samples:
            # Too few tokens proposed to time (adaptive k down to probes, for instance) and
            # too few accepted to pay even for free: nothing to learn quickly.
            if r.on_steps >= self.min_samples and r.free_gain() < 1 + self.margin:
                return self.confident_every
            return 2 * self.burst_steps
        if abs(math.log(r.gain())) >= self.confident_log_gain:
            return self.confident_every
        return self.explore_every

    def allow(self, n: int) -> bool:
        self._steps += 1
        if n <= 0 or (self.max_batch_size and n > self.max_batch_size):
            return False
        if not self.adaptive:
            return True
        r = self._ranges.setdefault(self.bucket(n), _Range())
        if r.last_step != self._steps - 1:
            # The range did not run last step: its timing baseline is from another moment
            # (other load, other requests) and pairs with nothing now.
            r.base = (0.0, 0.0, 0.0)
            r.burst_left = 0
        r.last_step = self._steps
        if r.burst_left > 0:
            r.burst_left -= 1
            return not r.speculate
        r.since_burst += 1
        if r.base[1] > 0 and r.since_burst > self._interval(r):
            r.since_burst = 0
            r.burst_left = self.burst_steps - 1
            r.burst = (0.0, 0.0, 0.0)
            return not r.speculate
        return r.speculate

    def observe(self, n: int, speculated: bool, num_tokens: int, seconds: float,
                num_proposed: int = 0) -> None:
        """A pure decode step of `n` requests, `num_proposed` tokens proposed, produced
        `num_tokens` in `seconds`."""
        if not self.adaptive or n <= 0 or seconds <= 0:
            return
        r = self._ranges.get(self.bucket(n))
        if r is None or r.last_step != self._steps:
            return
        if speculated:
            d = self.acceptance_decay
            r.on_requests = d * r.on_requests + n
            r.on_tokens = d * r.on_tokens + num_tokens
            r.on_proposed = d * r.on_proposed + num_proposed
            r.on_steps += 1
        step = (seconds, 1.0, num_proposed / n)
        if speculated == r.speculate:
            r.base = tuple(self.decay * b + x for b, x in zip(r.base, step, strict=True))
        else:
            r.burst = tuple(b + x for b, x in zip(r.burst, step, strict=True))
            if r.burst_left == 0 and r.base[1] > 0:
                self._cost_sample(r, speculated)
        if r.cost_samples >= self.min_samples:
            gain = r.gain()
            r.speculate = gain > 1 - self.margin if r.speculate else gain > 1 + self.margin
        elif r.on_steps >= self.min_samples:
            # No cost measured yet; a speculating step costs at least a plain one, so
            # acceptance alone can rule speculation out (a draft that is rarely right).
            r.speculate = r.free_gain() > 1 + self.margin

    def _cost_sample(self, r: _Range, burst_speculated: bool) -> None:
        on, off = (r.burst, r.base) if burst_speculated else (r.base, r.burst)
        proposed = on[2] / on[1]  # per request per speculating step
        if proposed < 0.5:
            return  # too little was proposed to see its cost
        ratio = (on[0] / on[1]) / (off[0] / off[1])
        sample = (ratio - 1.0) / proposed
        w = 1.0 if r.cost_samples == 0 else self.cost_weight
        r.cost = (1 - w) * r.cost + w * sample
        r.cost_samples += 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Per batch range: the estimated gain, the cost per proposed token, and whether the
        range speculates now (for logs and benchmarks)."""
        return {f"{1 << (b - 1)}+": {"gain": round(r.gain(), 3), "cost": round(r.cost, 3),
                                     "speculate": r.speculate}
                for b, r in sorted(self._ranges.items()) if r.cost_samples}
