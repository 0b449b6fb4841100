"""Worker identity and the Health answer every worker gives (used for routing and tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.v1 import common_pb2

from services.common import convert
from services.common.engine_loop import EngineLoop


@dataclass
class WorkerState:
    """Mutable identity of this worker process; `draining` is flipped by SIGTERM."""

    role: str
    worker_id: str
    model_name: str
    draining: bool = False


def health_response(loop: EngineLoop, worker: WorkerState, kv_endpoint: str) -> common_pb2.HealthResponse:
    status = common_pb2.HealthResponse.SERVING
    # A stuck engine step (the watchdog's verdict) routes new work elsewhere, as draining does.
    if worker.draining or not loop.ready:
        status = common_pb2.HealthResponse.DRAINING
    engine = loop.engine
    return common_pb2.HealthResponse(
        status=status,
        role=worker.role,
        model=worker.model_name,
        # The pace as of now: an idle worker's last busy seconds age out of it here too.
        stats=convert.stats_to_pb({**loop.stats, **loop.pace.snapshot(time.monotonic())}),
        kv_endpoint=kv_endpoint,
        block_size=engine.config.block_size,
        max_model_len=engine.servable_len,
        worker_id=worker.worker_id,
    )
