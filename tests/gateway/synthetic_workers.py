"""Worker endpoints with made-up Health answers, for routing tests that need no process."""

from __future__ import annotations

from splitserve.v1 import common_pb2

from services.gateway.routing.worker_pool import WorkerEndpoint


def worker(address: str, role: str = "decode", *, worker_id: str = "", model: str = "m",
           status: int = common_pb2.HealthResponse.SERVING, **stats) -> WorkerEndpoint:
    """A reachable worker whose last Health poll reported `stats` (WorkerStats fields)."""
    stats.setdefault("kv_blocks_total", 1000)
    stats.setdefault("kv_blocks_free", stats["kv_blocks_total"])
    health = common_pb2.HealthResponse(
        status=status, role=role, model=model, block_size=16, max_model_len=4096,
        worker_id=worker_id or f"{role}-{address}", stats=common_pb2.WorkerStats(**stats))
    return WorkerEndpoint(address=address, role=role, health=health, reachable=True,
                          worker_id=health.worker_id, model=model)


class StaticPool:
    """Stands in for WorkerPool where a test needs only its views."""

    def __init__(self, *endpoints: WorkerEndpoint, block_size: int = 16) -> None:
        self.endpoints = list(endpoints)
        self._block_size = block_size

    @property
    def disaggregated(self) -> bool:
        return any(e.role == "prefill" for e in self.endpoints)

    def decoders(self) -> list[WorkerEndpoint]:
        return [e for e in self.endpoints if e.decode_capable]

    def prefillers(self) -> list[WorkerEndpoint]:
        return [e for e in self.endpoints if e.role == "prefill"]

    def block_size(self) -> int:
        return self._block_size
