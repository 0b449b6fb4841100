"""Prefill scorer: prompt tokens whose KV the worker already holds in its prefix cache, i.e.
work it would not redo (unit: tokens; pairs with queued_prefill, also in tokens)."""

from __future__ import annotations

from typing import ClassVar

from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.worker_pool import WorkerEndpoint


class PrefixCacheScorer:
    name: ClassVar[str] = "prefix_cache"

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index

    def score(self, request: RoutingRequest, worker: WorkerEndpoint) -> float:
        return float(self.cached_tokens(request, worker))

    def cached_tokens(self, request: RoutingRequest, worker: WorkerEndpoint) -> int:
        blocks = self.index.matched_blocks(worker.worker_id, worker.address, request.block_hashes)
        return blocks * request.block_size
