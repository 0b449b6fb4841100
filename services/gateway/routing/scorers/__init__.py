"""The routing scorers by name, and the `name=weight,...` weights read from config."""

from __future__ import annotations

from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.scorers.base import RoutingRequest, Scorer
from services.gateway.routing.scorers.free_kv import FreeKVScorer
from services.gateway.routing.scorers.prefix_cache import PrefixCacheScorer
from services.gateway.routing.scorers.queued_prefill import QueuedPrefillScorer
from services.gateway.routing.scorers.running_load import RunningLoadScorer

SCORER_NAMES = ("free_kv", "running_load", "prefix_cache", "queued_prefill")
DEFAULT_DECODE_WEIGHTS = "free_kv=1,running_load=1"
DEFAULT_PREFILL_WEIGHTS = "prefix_cache=1,queued_prefill=1"


def parse_weights(text: str) -> tuple[tuple[str, float], ...]:
    """'free_kv=1,running_load=0.5' -> (('free_kv', 1.0), ('running_load', 0.5))."""
    weights = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if name not in SCORER_NAMES:
            raise ValueError(f"unknown scorer {name!r} (choose from {', '.join(SCORER_NAMES)})")
        try:
            weight = float(value) if sep else 1.0
        except ValueError:
            raise ValueError(f"weight of {name!r} is not a number: {value!r}") from None
        weights.append((name, weight))
    if not weights:
        raise ValueError("give at least one scorer, e.g. 'free_kv=1'")
    return tuple(weights)


def build_scorers(text: str, index: PrefixIndex) -> list[tuple[Scorer, float]]:
    made: dict[str, Scorer] = {
        "free_kv": FreeKVScorer(), "running_load": RunningLoadScorer(),
        "prefix_cache": PrefixCacheScorer(index), "queued_prefill": QueuedPrefillScorer(),
    }
    return [(made[name], weight) for name, weight in parse_weights(text)]


__all__ = ["RoutingRequest", "Scorer", "SCORER_NAMES", "parse_weights", "build_scorers",
           "DEFAULT_DECODE_WEIGHTS", "DEFAULT_PREFILL_WEIGHTS"]
