"""The numbers the comparison is judged by, derived from a sweep's results.json points: peak
goodput, the maximum sustainable rate (where TTFT p99 crosses the target) and interference ITL."""

from __future__ import annotations

from dataclasses import dataclass


def points_of(results: dict, system: str, workload: str) -> list[dict]:
    pts = [p for p in results["points"] if p["system"] == system and p["workload"] == workload]
    return sorted(pts, key=lambda p: -1.0 if p["rate"] is None else p["rate"])


def offered(point: dict) -> str:
    """The load a point offered: a rate, a burst or a closed loop of N clients."""
    if point["rate"] is not None:
        return f"{point['rate']:g} req/s"
    concurrency = point.get("concurrency")
    return f"{concurrency} at a time" if concurrency else "burst"


def failed(point: dict) -> bool:
    """Timeouts, or most requests lost: the latencies of the few that finished say little."""
    s = point["summary"]
    return s["timeouts"] > 0 or s["completed"] < s["requests"] / 2


# A rate is sustained only if (nearly) every request was served: with admission on, the gateway
# keeps TTFT within the target by refusing the excess, and the TTFT of the served ones alone
# would then call any rate sustainable.
MAX_REFUSED_SHARE = 0.01


def refused(summary: dict) -> int:
    """Requests the server refused (429 quota / 503 capacity), as admission answers overload."""
    return summary["rejected_429"] + summary["rejected_503"]


def _ttft_p99(point: dict) -> float | None:
    """TTFT p99 of a point, or None when the point failed outright or refused more than
    MAX_REFUSED_SHARE of its requests: such a point is past any TTFT target."""
    s = point["summary"]
    if failed(point) or refused(s) > MAX_REFUSED_SHARE * s["requests"]:
        return None
    return s["ttft_s"]["p99"]


@dataclass(frozen=True)
class RateBound:
    """Where TTFT p99 crosses the target: between `low` (last rate within it; None if even the
    first rate missed) and `high` (first rate past it; None if no swept rate missed). `estimate`
    interpolates TTFT p99 linearly between the two when both are measured."""

    low: float | None
    high: float | None
    estimate: float | None

    def text(self) -> str:
        if self.low is None:
            return f"< {self.high:g} req/s (the lowest rate already missed)"
        if self.high is None:
            return f">= {self.low:g} req/s (no swept rate missed)"
        around = f"~{self.estimate:.2f} req/s, " if self.estimate is not None else ""
        return f"{around}between {self.low:g} and {self.high:g} req/s"

    @property
    def value(self) -> float | None:
        """The best single number: the estimate, else the last rate known to be sustainable."""
        return self.estimate if self.estimate is not None else self.low


def max_sustainable_rate(points: list[dict], ttft_target_s: float) -> RateBound | None:
    swept = [p for p in points if p["rate"] is not None]
    if not swept:
        return None
    prev_rate = prev_ttft = None
    for p in swept:
        ttft = _ttft_p99(p)
        if ttft is None or ttft > ttft_target_s:
            if prev_rate is None:
                return RateBound(None, p["rate"], None)
            estimate = None
            if ttft is not None and ttft > prev_ttft:
                frac = (ttft_target_s - prev_ttft) / (ttft - prev_ttft)
                estimate = prev_rate + frac * (p["rate"] - prev_rate)
            return RateBound(prev_rate, p["rate"], estimate)
        prev_rate, prev_ttft = p["rate"], ttft
    return RateBound(prev_rate, None, None)


def peak_goodput(points: list[dict]) -> tuple[float, float | None]:
    """(highest goodput in req/s, the rate it was reached at)."""
    best = (0.0, None)
    for p in points:
        if p["summary"]["goodput"] > best[0]:
            best = (p["summary"]["goodput"], p["rate"])
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def class_metric(point: dict, cls: str, metric: str, stat: str) -> float | None:
    summary = point["by_class"].get(cls)
    return None if summary is None else summary[metric][stat]
