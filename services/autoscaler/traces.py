"""Request traces for the simulator and the measured runs: Poisson arrivals with a rate that
follows a shape in time (steady, diurnal, a spike) and lengths drawn from a WorkloadShape."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.autoscaler.capacity import WorkloadShape

if TYPE_CHECKING:
    from services.autoscaler.day_plan import DayShape


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the trace start
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    base_rate: float  # requests/s the trace starts at
    peak_rate: float  # the highest rate of its rate function
    requests: tuple[TraceRequest, ...]
    failures: tuple[tuple[float, str], ...] = ()  # (time, role): one replica of role dies


def poisson_trace(name: str, rate: Callable[[float], float], peak_rate: float, duration_s: float,
                  shape: WorkloadShape, seed: int = 0, jitter: float = 0.25,
                  failures: tuple[tuple[float, str], ...] = ()) -> Trace:
    """Non-homogeneous Poisson arrivals by thinning; each length drawn from its class, then
    spread uniformly by +-jitter."""
    rng = random.Random(seed)
    weights = [c.weight for c in shape.classes]
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(peak_rate)
        if t >= duration_s:
            break
        if rng.random() * peak_rate > rate(t):
            continue
        cls = rng.choices(shape.classes, weights)[0]
        requests.append(TraceRequest(
            t, _spread(rng, cls.prompt_tokens, jitter), _spread(rng, cls.output_tokens, jitter)))
    return Trace(name, duration_s, rate(0.0), peak_rate, tuple(requests), failures)


def _spread(rng: random.Random, n: int, jitter: float) -> int:
    return max(1, round(n * (1 + rng.uniform(-jitter, jitter))))


def steady(rate: float, shape: WorkloadShape, duration_s: float = 900, seed: int = 0) -> Trace:
    return poisson_trace("steady", lambda t: rate, rate, duration_s, shape, seed)


def diurnal(base: float, peak: float, shape: WorkloadShape, duration_s: float = 3600,
            seed: int = 0) -> Trace:
    """One compressed day: base at the start and end, peak in the middle (raised cosine)."""
    def rate(t: float) -> float:
        return base + (peak - base) * (1 - math.cos(2 * math.pi * t / duration_s)) / 2
    return poisson_trace("diurnal", rate, peak, duration_s, shape, seed)


def spike(base: float, shape: WorkloadShape, factor: float = 10.0, at_s: float = 300,
          length_s: float = 60, duration_s: float = 900, seed: int = 0) -> Trace:
    """base, then factor x base for length_s seconds from at_s, then base again."""
    def rate(t: float) -> float:
        return base * factor if at_s <= t < at_s + length_s else base
    return poisson_trace("spike", rate, base * factor, duration_s, shape, seed)


def failure(rate: float, shape: WorkloadShape, duration_s: float = 900, seed: int = 0,
            at: tuple[tuple[float, str], ...] = ((300.0, "decode"), (500.0, "prefill"))) -> Trace:
    """Steady load; one replica of each role dies (decode first, then prefill)."""
    return poisson_trace("failure", lambda t: rate, rate, duration_s, shape, seed, failures=at)


def day_window(day: DayShape, shape: WorkloadShape, start_s: float, duration_s: float, share: float = 1.0,
               seed: int = 0, failures: tuple[tuple[float, str], ...] = ()) -> Trace:
    """`duration_s` of a DayShape from `start_s` seconds after midnight, at `share` of its
    traffic (one cell of a fleet: a share of 0.02 is the cluster 1/50 of the fleet serves).
    Time in the trace starts at 0; failures are at trace times."""
    if not 0 < share <= 1 or duration_s <= 0:
        raise ValueError("share must be in (0, 1] and duration_s > 0")

    def rate(t: float) -> float:
        return share * day.rate(start_s + t)
    # Thinning needs the window's highest rate: the curve on a 1 s grid, and the spike if it
    # falls inside.
    peak = max(rate(float(t)) for t in range(int(duration_s) + 1))
    if start_s < day.spike_start_s + day.spike_s and day.spike_start_s < start_s + duration_s:
        peak = max(peak, share * day.spike_rate)
    return poisson_trace("day", rate, peak, duration_s, shape, seed, failures=failures)
