"""Which workers serve a request. A small interface so that registry-backed, prefix-aware
routing can replace the simple policy here without touching the dispatcher."""

from __future__ import annotations

import itertools
from collections.abc import Collection
from typing import Protocol

from services.gateway.worker_pool import WorkerEndpoint, WorkerPool


class Router(Protocol):
    def choose_decode(self, exclude: Collection[str] = ()) -> WorkerEndpoint | None:
        """A decode-capable worker, avoiding addresses in `exclude` unless none other is left."""

    def choose_prefill(self, exclude: Collection[str] = ()) -> WorkerEndpoint | None:
        """A prefill worker, with the same fallback."""

    def ready(self) -> bool:
        """Whether requests can be routed at all."""


class LeastLoadedRouter:
    """Decode: most free KV blocks (last poll minus what was handed out since). Prefill: fewest
    requests in flight from this gateway, round-robin among ties. Runs on the event loop."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool
        self._turn = itertools.count()

    def ready(self) -> bool:
        return self.pool.ready()

    def choose_decode(self, exclude: Collection[str] = ()) -> WorkerEndpoint | None:
        candidates = _prefer_unexcluded([e for e in self.pool.decoders() if e.routable], exclude)
        if not candidates:
            return None
        return max(candidates, key=lambda e: (e.kv_blocks_free, -e.outstanding))

    def choose_prefill(self, exclude: Collection[str] = ()) -> WorkerEndpoint | None:
        candidates = _prefer_unexcluded([e for e in self.pool.prefillers() if e.routable], exclude)
        if not candidates:
            return None
        least = min(e.outstanding for e in candidates)
        tied = [e for e in candidates if e.outstanding == least]
        return tied[next(self._turn) % len(tied)]


def _prefer_unexcluded(endpoints: list[WorkerEndpoint], exclude: Collection[str]) -> list[WorkerEndpoint]:
    fresh = [e for e in endpoints if e.address not in exclude]
    return fresh or endpoints
