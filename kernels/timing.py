"""Timing two ways of doing the same work side by side, for the choices the engine measures at
start (kernels/linear.py's small-M row count, kernels/attention.py's prefill attention)."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_seconds(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each path's best time over `repeats` passes, the paths alternating within each pass, after
    one untimed pass that warms all of them up."""
    best = dict.fromkeys(paths, float("inf"))
    for attempt in range(repeats + 1):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            if attempt:
                best[name] = min(best[name], time.perf_counter() - start)
    return best
