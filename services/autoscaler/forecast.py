"""Short-term demand forecast: Holt's linear smoothing (a level and a trend) of one rate,
sampled at irregular intervals, extrapolated over the time a new replica needs to start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrendForecaster:
    """alpha weighs the newest sample in the level, beta the newest slope in the trend.
    A forecast never exceeds (1 + max_growth) times the larger of level and latest sample, so
    one noisy jump cannot extrapolate into a stampede of replicas."""

    alpha: float = 0.15
    beta: float = 0.05
    max_growth: float = 1.0
    # Two samples in a row above jump_ratio x level are a step, not noise: the level moves
    # there at once instead of creeping up over many samples.
    jump_ratio: float = 2.0
    level: float | None = None
    trend: float = 0.0  # per second
    latest: float = 0.0
    _time: float = 0.0

    def observe(self, time: float, value: float) -> None:
        value = max(0.0, value)
        previous, self.latest = self.latest, value
        if self.level is None:
            self.level, self._time = value, time
            return
        dt = time - self._time
        if dt <= 0:
            return
        if self.level > 0 and min(previous, value) > self.jump_ratio * self.level:
            self.level, self.trend, self._time = (previous + value) / 2, 0.0, time
            return
        predicted = self.level + self.trend * dt
        level = self.alpha * value + (1 - self.alpha) * predicted
        self.trend = self.beta * (level - self.level) / dt + (1 - self.beta) * self.trend
        self.level, self._time = level, time

    def forecast(self, horizon_s: float) -> float:
        """The rate expected horizon_s after the last sample."""
        if self.level is None:
            return 0.0
        ahead = self.level + self.trend * horizon_s
        cap = (1 + self.max_growth) * max(self.level, self.latest)
        return min(max(ahead, 0.0), cap)

    def smoothed(self) -> float:
        return self.level or 0.0
