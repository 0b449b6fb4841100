"""Arrival processes: when each request is sent. Open-loop processes return send times drawn from
a seeded generator; `ClosedLoop` instead keeps a fixed number of requests in flight."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _renewal_times(gaps, duration_s: float, expected: float) -> np.ndarray:
    """Cumulative sums of i.i.d. gaps, cut at duration_s. `gaps(n)` draws n gaps."""
    chunk = max(16, int(expected * 1.2) + 16)
    times: list[np.ndarray] = []
    last = 0.0
    while last < duration_s:
        t = last + np.cumsum(gaps(chunk))
        times.append(t)
        last = float(t[-1])
    all_times = np.concatenate(times) if times else np.empty(0)
    return all_times[all_times < duration_s]


@dataclass(frozen=True)
class Poisson:
    """Exponential gaps with mean 1/rate: independent arrivals at `rate` requests per second."""

    rate: float

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError("Poisson rate must be > 0")

    def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        return _renewal_times(lambda n: rng.exponential(1.0 / self.rate, n),
                              duration_s, self.rate * duration_s)

    def describe(self) -> str:
        return f"poisson(rate={self.rate:g}/s)"


@dataclass(frozen=True)
class Gamma:
    """Gamma-distributed gaps with mean 1/rate and shape `burstiness`: 1 is Poisson, below 1
    clusters arrivals into bursts (coefficient of variation 1/sqrt(burstiness)), above 1 evens
    them out."""

    rate: float
    burstiness: float = 1.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burstiness <= 0:
            raise ValueError("gamma rate and burstiness must be > 0")

    def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        scale = 1.0 / (self.rate * self.burstiness)
        return _renewal_times(lambda n: rng.gamma(self.burstiness, scale, n),
                              duration_s, self.rate * duration_s)

    def describe(self) -> str:
        return f"gamma(rate={self.rate:g}/s, burstiness={self.burstiness:g})"


@dataclass(frozen=True)
class Spike:
    """Poisson at `rate`, except `factor` times that rate for `length_s` seconds from `start_s`:
    a step spike such as 10x for 30 s."""

    rate: float
    factor: float = 10.0
    start_s: float = 30.0
    length_s: float = 30.0

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.factor <= 0 or self.start_s < 0 or self.length_s <= 0:
            raise ValueError("spike needs rate > 0, factor > 0, start >= 0, length > 0")

    def segments(self, duration_s: float) -> list[tuple[float, float, float]]:
        """(begin, end, rate) pieces covering [0, duration_s)."""
        edges = [(0.0, self.start_s, self.rate),
                 (self.start_s, self.start_s + self.length_s, self.rate * self.factor),
                 (self.start_s + self.length_s, duration_s, self.rate)]
        return [(b, min(e, duration_s), r) for b, e, r in edges if b < min(e, duration_s)]

    def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        # Exponential gaps are memoryless, so each constant-rate piece is an independent Poisson
        # process on its own interval.
        pieces = [begin + Poisson(rate).times(end - begin, rng)
                  for begin, end, rate in self.segments(duration_s)]
        return np.concatenate(pieces) if pieces else np.empty(0)

    def describe(self) -> str:
        return (f"spike(rate={self.rate:g}/s, x{self.factor:g} for {self.length_s:g}s "
                f"from t={self.start_s:g}s)")


@dataclass(frozen=True)
class Burst:
    """`count` requests all sent at t=0."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("burst count must be >= 1")

    def times(self, duration_s: float, rng: np.random.Generator) -> np.ndarray:
        return np.zeros(self.count)

    def describe(self) -> str:
        return f"burst({self.count})"


@dataclass(frozen=True)
class ClosedLoop:
    """`concurrency` clients, each sending its next request when the previous one ends."""

    concurrency: int

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")

    def describe(self) -> str:
        return f"closed-loop(concurrency={self.concurrency})"


OpenLoop = Poisson | Gamma | Spike | Burst
ArrivalProcess = OpenLoop | ClosedLoop
