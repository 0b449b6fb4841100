"""Decode scorer: the share of a worker's KV cache that is free, so long outputs land where
they have room (unit: fraction of its blocks, 0..1)."""

from __future__ import annotations

from typing import ClassVar

from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.worker_pool import WorkerEndpoint


class FreeKVScorer:
    name: ClassVar[str] = "free_kv"

    def score(self, request: RoutingRequest, worker: WorkerEndpoint) -> float:
        total = worker.stats.kv_blocks_total
        if total <= 0:
            return 0.0
        # Blocks this gateway reserved since the last poll are not in the polled count yet.
        free = worker.stats.kv_blocks_free - worker.blocks_since_poll
        return min(max(free / total, 0.0), 1.0)
