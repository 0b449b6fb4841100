"""Follows the worker registry in Redis for one gateway: worker entries (joins, departures,
draining) into the WorkerPool, and the prefix-cache event stream into the PrefixIndex.

Two tasks on the gateway's event loop. If Redis is unreachable the pool keeps the workers it
last saw (their Health polls still take dead ones out of rotation) and the index keeps what
it knew; routing history covers the events missed meanwhile.

With the cluster secret, an entry or event not signed with it is ignored and counted in
`splitserve_gateway_registry_rejected_total` (kind, reason): whoever can write to Redis cannot
add a worker, move one to another address, or steer routing with made-up prefix events.
"""

from __future__ import annotations

import asyncio
import logging

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter

from engine.block_pool import HASH_BYTES
from services.common.registry import (
    PREFIX_STREAM,
    REJECT_REASONS,
    prefix_event_signed,
    scan_workers,
)
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.worker_pool import WorkerPool

log = logging.getLogger(__name__)

_STREAM_BLOCK_MS = 1000
_STREAM_BATCH = 1000
_HASH_LIMIT = 1 << (8 * HASH_BYTES)


class RegistryFollower:
    def __init__(self, redis_url: str, pool: WorkerPool, index: PrefixIndex,
                 interval_s: float = 0.5, secret: bytes | None = None) -> None:
        self.pool = pool
        self.secret = secret
        self.index = index
        self.interval_s = interval_s
        self.redis = aioredis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
        # Its own connection pool: XREAD blocks, and must not hold up the membership scans.
        self.stream_redis = aioredis.from_url(
            redis_url, socket_timeout=_STREAM_BLOCK_MS / 1000 + 5, socket_connect_timeout=2)
        self.last_event_id = "0-0"  # replay the stream from its start: the index is rebuilt
        self.connected = False
        self._tasks: list[asyncio.Task] = []
        # A rejected key is counted (and logged) once while it stays rejected for the same reason,
        # not at every scan or heartbeat: key -> reason.
        self._rejected: dict[str, str] = {}
        self.rejected = Counter(
            "splitserve_gateway_registry_rejected",
            "Registry entries (kind=worker) and prefix events (kind=prefix_event) ignored, by "
            "reason (malformed, unsigned, bad_signature, stale).",
            ["kind", "reason"], registry=None)
        for reason in REJECT_REASONS:
            self.rejected.labels("worker", reason)  # exported as 0 until one happens

    def register_metrics(self, registry: CollectorRegistry) -> None:
        registry.register(self.rejected)

    async def start(self) -> None:
        try:
            await self.sync_workers()
        except Exception as exc:  # not fatal: workers may be given by address too
            log.warning("redis registry unreachable at start-up: %s", exc)
        await self.pool.poll_once()
        self._tasks = [
            asyncio.create_task(self._watch_workers(), name="registry-workers"),
            asyncio.create_task(self._follow_prefix_events(), name="registry-prefix-events"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(self.redis.aclose(), self.stream_redis.aclose(),
                             return_exceptions=True)

    async def sync_workers(self) -> None:
        workers, rejected = await scan_workers(self.redis, self.secret)
        for key, reason in rejected.items():
            if self._rejected.get(key) != reason:
                self.rejected.labels("worker", reason).inc()
                log.warning("ignoring registry entry %s (%s): it will get no traffic", key,
                            reason)
        self._rejected = rejected
        if not self.connected:
            log.info("following the worker registry in redis (%d workers registered)",
                     len(workers))
            self.connected = True
        joined, departed = self.pool.apply_registry(workers)
        for endpoint in joined:
            log.info("worker joined: %s %s at %s (%s)", endpoint.role, endpoint.worker_id,
                     endpoint.address, endpoint.model)
        for endpoint in departed:
            log.info("worker left: %s %s at %s (%d requests still on it)", endpoint.role,
                     endpoint.worker_id, endpoint.address, endpoint.outstanding)

    async def _watch_workers(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sync_workers()
            except Exception as exc:
                if self.connected:
                    log.warning("redis registry unreachable; keeping the last known workers: %s",
                                exc)
                self.connected = False

    async def _follow_prefix_events(self) -> None:
        while True:
            try:
                batches = await self.stream_redis.xread(
                    {PREFIX_STREAM: self.last_event_id}, count=_STREAM_BATCH,
                    block=_STREAM_BLOCK_MS)
            except Exception as exc:
                log.debug("prefix event stream unreachable: %s", exc)
                await asyncio.sleep(self.interval_s)
                continue
            for _stream, entries in batches or ():
                for entry_id, fields in entries:
                    self.last_event_id = entry_id
                    self._apply(fields)

    def _apply(self, fields: dict) -> None:
        if self.secret and not prefix_event_signed(fields, self.secret):
            reason = "bad_signature" if b"sig" in fields else "unsigned"
            self.rejected.labels("prefix_event", reason).inc()
            log.debug("ignoring a prefix event (%s)", reason)
            return
        try:
            worker = fields[b"worker"].decode()
            kind = fields[b"kind"].decode()
            # Block hashes: 16-byte digests as decimal ints (engine.block_pool), salted per tenant.
            hashes = [int(h) for h in fields[b"hashes"].split(b",") if h]
            if not all(0 <= h < _HASH_LIMIT for h in hashes):
                raise ValueError(f"a block hash outside [0, 2^{8 * HASH_BYTES})")
        except (KeyError, ValueError) as exc:
            log.warning("skipping a malformed prefix event: %r (%s)", fields, exc)
            return
        self.index.apply_event(worker, kind, hashes)
