"""Decode scorer: fewer requests running or queued on the worker is better (unit: 1/(1 + load),
so 1.0 for an idle worker, falling toward 0 as requests pile up)."""

from __future__ import annotations

from typing import ClassVar

from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.worker_pool import WorkerEndpoint


class RunningLoadScorer:
    name: ClassVar[str] = "running_load"

    def score(self, request: RoutingRequest, worker: WorkerEndpoint) -> float:
        return 1.0 / (1.0 + worker_load(worker))


def worker_load(worker: WorkerEndpoint) -> int:
    """Requests running, queued or waiting for KV on the worker at its last poll, plus those
    this gateway sent it since."""
    stats = worker.stats
    return stats.running + stats.waiting + stats.waiting_for_kv + worker.requests_since_poll
