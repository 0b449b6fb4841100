"""Interleaved sweeps (`bench.compare --rounds N`): each point ran N times, the systems taking
turns. Which figure judges a round, and which round stands for a point in the tables."""

from __future__ import annotations

# The metric that picks a point's median round (interleaved runs) and its Rounds row: the
# workload's headline figure, TTFT p99 for the rest. (summary path, label, higher is better)
ROUND_METRICS = {
    "burst": (("output_throughput",), "out tok/s", True),
    "batch1": (("itl_s", "p50"), "ITL p50 ms", False),
    "long": (("ttft_s", "p50"), "TTFT p50 ms", False),
}
TTFT_P99 = (("ttft_s", "p99"), "TTFT p99 ms", False)


def round_metric(point: dict) -> float | None:
    path, _, _ = ROUND_METRICS.get(point["workload"], TTFT_P99)
    value = point["summary"]
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def median_rounds(results: dict) -> dict:
    """`results` with one point per system, workload and rate: in an interleaved run (points
    with a "round"), the median round by round_metric (of an even count the worse of the two
    middle ones; a round without the figure counts as the worst). Other runs come back as they
    are."""
    if not any("round" in p for p in results["points"]):
        return results
    groups: dict[tuple, list[dict]] = {}
    for p in results["points"]:
        groups.setdefault((p["system"], p["workload"], p["rate"]), []).append(p)

    def goodness(p: dict) -> float:
        v = round_metric(p)
        return float("-inf") if v is None else (v if higher_is_better(p["workload"]) else -v)

    chosen = {id(worse_middle(pts, goodness)) for pts in groups.values()}
    return {**results, "points": [p for p in results["points"] if id(p) in chosen]}


def worse_middle(items: list, goodness) -> object:
    """The median of `items` by `goodness` (higher is better); of an even count, the worse of
    the two middle ones."""
    return sorted(items, key=goodness)[(len(items) - 1) // 2]


def higher_is_better(workload: str) -> bool:
    return ROUND_METRICS.get(workload, TTFT_P99)[2]


def rounds_by_point(results: dict) -> dict[tuple, dict[int, dict[str, float | None]]]:
    """An interleaved run's points as (workload, rate) -> round -> system -> round_metric, points
    in the order they ran, rounds in order."""
    table: dict[tuple, dict[int, dict[str, float | None]]] = {}
    for p in results["points"]:
        if "round" in p:
            by_round = table.setdefault((p["workload"], p["rate"]), {})
            by_round.setdefault(p["round"], {})[p["system"]] = round_metric(p)
    return {key: dict(sorted(by_round.items())) for key, by_round in table.items()}


def advantage(workload: str, ours: float | None, theirs: float | None) -> float | None:
    """How many times better `ours` is than `theirs` (> 1: better): throughput ours / theirs,
    a latency theirs / ours."""
    if not ours or not theirs:
        return None
    return ours / theirs if higher_is_better(workload) else theirs / ours
