"""Prefill scorer: prompt tokens already queued on the worker, which this prompt would wait
behind (unit: minus tokens, so that with prefix_cache the sum is the work saved minus the
work ahead)."""

from __future__ import annotations

from typing import ClassVar

from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.worker_pool import WorkerEndpoint


class QueuedPrefillScorer:
    name: ClassVar[str] = "queued_prefill"

    def score(self, request: RoutingRequest, worker: WorkerEndpoint) -> float:
        return -float(queued_tokens(worker))


def queued_tokens(worker: WorkerEndpoint) -> int:
    """Prompt tokens ahead of a new prompt: queued at the last poll (waiting prompts and the
    rest of those in chunked prefill) plus what this gateway sent since, or this gateway's
    unanswered prefills if more (they count whole prompts, computed parts included)."""
    polled = worker.stats.queued_prefill_tokens + worker.prefill_tokens_since_poll
    return max(polled, worker.prefill_tokens_in_flight)
