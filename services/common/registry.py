"""The worker registry in Redis: workers announce themselves with a heartbeat that expires,
gateways list who is alive. Prefix-cache events (block hashes stored / evicted) go to a
Redis stream that routers follow.

Keys: `splitserve:worker:<id>` (JSON WorkerInfo, TTL = heartbeat TTL) and the stream
`splitserve:prefix-events` (fields: worker, kind, hashes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

WORKER_KEY = "splitserve:worker:"
PREFIX_STREAM = "splitserve:prefix-events"
PREFIX_STREAM_MAXLEN = 200_000


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str  # prefill | decode | both
    address: str  # gRPC host:port
    kv_endpoint: str
    model: str
    block_size: int
    max_model_len: int
    metrics_address: str = ""
    draining: bool = False
    stats: dict = field(default_factory=dict)
    updated: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> WorkerInfo:
        return cls(**json.loads(raw))


class RegistryPublisher:
    """Worker side. Runs on the worker's event loop; `describe()` must be cheap and
    thread-safe (it reads snapshots), `drain_events()` pops prefix events (deque)."""

    def __init__(self, redis_url: str, describe: Callable[[], WorkerInfo],
                 drain_events: Callable[[], list[tuple[str, int]]] | None = None,
                 ttl_s: float = 5.0, interval_s: float = 1.0) -> None:
        self.redis = aioredis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.describe = describe
        self.drain_events = drain_events
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self.connected = False

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self.publish_once()
                if not self.connected:
                    log.info("registered in redis")
                self.connected = True
            except Exception as exc:  # Redis down: keep serving, retry next beat
                if self.connected:
                    log.warning("redis heartbeat failed: %s", exc)
                self.connected = False
            await asyncio.sleep(self.interval_s)

    async def publish_once(self) -> None:
        info = self.describe()
        info = WorkerInfo(**{**asdict(info), "updated": time.time()})
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(WORKER_KEY + info.worker_id, info.to_json(), px=int(self.ttl_s * 1000))
        if self.drain_events is not None:
            events = self.drain_events()
            for kind in ("stored", "evicted"):
                hashes = [str(h) for k, h in events if k == kind]
                if hashes:
                    pipe.xadd(PREFIX_STREAM, {"worker": info.worker_id, "kind": kind,
                                              "hashes": ",".join(hashes)},
                              maxlen=PREFIX_STREAM_MAXLEN, approximate=True)
        await pipe.execute()

    async def deregister(self, worker_id: str) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.redis.delete(WORKER_KEY + worker_id)
        except Exception as exc:
            log.warning("could not deregister from redis: %s", exc)
        await self.redis.aclose()


async def list_workers(redis: aioredis.Redis) -> list[WorkerInfo]:
    """Every worker whose heartbeat has not expired."""
    keys = [k async for k in redis.scan_iter(match=WORKER_KEY + "*", count=500)]
    if not keys:
        return []
    values = await redis.mget(keys)
    return [WorkerInfo.from_json(v) for v in values if v is not None]
