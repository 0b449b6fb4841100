"""The workers a gateway knows, their gRPC stubs, their last Health answer and circuit breaker.

Workers come from flags (static, never removed) and, with Redis, from the registry (added and
removed as their heartbeats appear and expire). Owned by the gateway's event loop: the poll
task, the registry follower and request handlers run there, so the fields need no locks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import grpc
from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from services.common.registry import WorkerInfo
from services.common.security import TLSFiles, aio_channel
from services.gateway.routing.circuit_breaker import CircuitBreaker

log = logging.getLogger(__name__)

# Keepalive: a worker that stops answering (a frozen process, a vanished node) breaks its
# streams within keepalive time + ping timeout (at most 20 s), and the gateway migrates them.
# gRPC waits for a ping's answer `grpc.http2.ping_timeout_ms` (60 s by default), whatever
# `keepalive_timeout_ms` says: streams on a SIGSTOPped worker waited ~70 s. The workers'
# servers accept pings this often (services/common/server.py).
KEEPALIVE_TIME_MS = 10_000
PING_TIMEOUT_MS = 10_000
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", PING_TIMEOUT_MS),
    ("grpc.http2.ping_timeout_ms", PING_TIMEOUT_MS),
    # Reconnect to a worker that went away at least every 2 s: gRPC's default backoff grows to
    # 2 minutes, and a worker restarted on its address after 27 s down was seen 16.6 s late.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
_EMPTY_STATS = common_pb2.WorkerStats()


@dataclass(eq=False)
class WorkerEndpoint:
    """One worker as seen from this gateway. Counters named `*_since_poll` hold what this
    gateway sent since the last Health answer, whose numbers lag by up to a poll interval."""

    address: str
    role: str  # "prefill", "decode" or "both"
    channel: grpc.aio.Channel | None = None
    prefill: prefill_pb2_grpc.PrefillStub | None = None
    decode: decode_pb2_grpc.DecodeStub | None = None
    worker_id: str = ""  # from the registry or Health
    model: str = ""  # the model (version) it serves; KV moves only between equal ones
    static: bool = True  # from flags; registry workers leave when their heartbeat does
    health: common_pb2.HealthResponse | None = None
    reachable: bool = False
    draining: bool = False
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    outstanding: int = 0  # requests this gateway has in flight on it
    blocks_since_poll: int = 0
    requests_since_poll: int = 0
    prefill_tokens_since_poll: int = 0
    # Uncached prompt tokens of this gateway's prefill calls not answered yet: unlike the
    # polled queue, it counts the prompt being computed right now.
    prefill_tokens_in_flight: int = 0
    last_error: str = ""
    missing_since: float | None = None  # registry workers: when its entry was last not found
    # When the last Health poll that found it serving began (monotonic): a stream that failed
    # here before then is not moved back to it (Dispatcher._migration_route).
    serving_polled_at: float = 0.0

    @property
    def routable(self) -> bool:
        """Healthy and taking work, whatever its breaker says."""
        return (self.reachable and not self.draining and self.health is not None
                and self.health.status == common_pb2.HealthResponse.SERVING)

    def available(self) -> bool:
        """Routable and its circuit breaker lets a request through."""
        return self.routable and self.breaker.available()

    @property
    def stats(self) -> common_pb2.WorkerStats:
        return self.health.stats if self.health is not None else _EMPTY_STATS

    @property
    def kv_blocks_free(self) -> int:
        if self.health is None:
            return 0
        return self.health.stats.kv_blocks_free - self.blocks_since_poll

    @property
    def decode_capable(self) -> bool:
        return self.role in ("decode", "both")

    def mark_failed(self, reason: str) -> None:
        """Its Health call failed: stop routing to it until a poll says otherwise."""
        self.reachable = False
        self.last_error = reason

    def record_failure(self, error: grpc.aio.AioRpcError) -> None:
        """A request's RPC failed here. A draining worker's refusal takes it out of rotation
        at once (no poll needed) without counting against its breaker."""
        self.last_error = f"{error.code().name}: {error.details()}"
        if error.code() == grpc.StatusCode.UNAVAILABLE and "draining" in (error.details() or ""):
            self.draining = True
            return
        if self.breaker.record_failure(error.code()):
            log.warning("worker %s out of rotation (circuit open) after %d failures: %s",
                        self.address, self.breaker.consecutive_failures, self.last_error)


@dataclass
class WorkerPool:
    prefill_addresses: list[str] = field(default_factory=list)
    decode_addresses: list[str] = field(default_factory=list)
    both_addresses: list[str] = field(default_factory=list)
    poll_interval_s: float = 1.0
    poll_timeout_s: float = 2.0
    new_breaker: Callable[[], CircuitBreaker] = CircuitBreaker
    # Called when a worker's prefix cache is gone: it left, or restarted in place.
    on_cache_lost: Callable[[WorkerEndpoint], None] | None = None
    # Called when a worker leaves the pool (e.g. to drop its metric label values).
    on_departed: Callable[[WorkerEndpoint], None] | None = None
    # Mutual TLS to every worker when set (a worker whose certificate does not chain to the CA
    # fails the handshake, so its Health poll fails and it is never routable).
    tls: TLSFiles | None = None
    # A registry worker whose entry is gone but whose health check still says SERVING stays
    # this long: a Redis that restarted empty lost every entry for the second or so until the
    # next heartbeats, and the gateway answered 503 meanwhile (a chaos audit: 3 of 83 requests).
    # A worker that drains or dies leaves at once (its health check says so).
    registry_grace_s: float = 10.0

    def __post_init__(self) -> None:
        self.endpoints: list[WorkerEndpoint] = []
        self._retiring: list[WorkerEndpoint] = []  # removed, closed once idle
        self._background: set[asyncio.Task] = set()
        for role, addresses in (("prefill", self.prefill_addresses),
                                ("decode", self.decode_addresses),
                                ("both", self.both_addresses)):
            for address in addresses:
                self.add(address, role, static=True)
        self._poll_task: asyncio.Task | None = None

    # -- membership ---------------------------------------------------------------------------

    def add(self, address: str, role: str, *, worker_id: str = "", model: str = "",
            static: bool = False) -> WorkerEndpoint:
        channel = aio_channel(address, self.tls, _CHANNEL_OPTIONS)
        endpoint = WorkerEndpoint(
            address=address, role=role, channel=channel, worker_id=worker_id, model=model,
            static=static, breaker=self.new_breaker(),
            prefill=prefill_pb2_grpc.PrefillStub(channel) if role != "decode" else None,
            decode=decode_pb2_grpc.DecodeStub(channel) if role != "prefill" else None,
        )
        self.endpoints.append(endpoint)
        return endpoint

    def remove(self, endpoint: WorkerEndpoint) -> None:
        """Out of the pool now; its channel stays open for the requests still on it."""
        if endpoint in self.endpoints:
            self.endpoints.remove(endpoint)
            self._retiring.append(endpoint)
            if self.on_cache_lost is not None:
                self.on_cache_lost(endpoint)
            if self.on_departed is not None:
                self.on_departed(endpoint)

    def find(self, address: str) -> WorkerEndpoint | None:
        return next((e for e in self.endpoints if e.address == address), None)

    def apply_registry(self, workers: Iterable[WorkerInfo]) -> tuple[list[WorkerEndpoint], list[WorkerEndpoint]]:
        """Make the registry-sourced part of the pool match the live registry entries.
        Returns (joined, departed). Static workers are never removed."""
        live = {info.address: info for info in workers}
        joined, departed = [], []
        now = time.monotonic()
        for endpoint in list(self.endpoints):
            info = live.get(endpoint.address)
            if info is None:
                if endpoint.static:
                    continue
                if endpoint.missing_since is None:
                    endpoint.missing_since = now
                if not endpoint.routable or now - endpoint.missing_since >= self.registry_grace_s:
                    self.remove(endpoint)
                    departed.append(endpoint)
                continue
            endpoint.missing_since = None
            if not endpoint.static and (info.role != endpoint.role or (
                    endpoint.worker_id and info.worker_id != endpoint.worker_id)):
                # Another worker now answers at this address: treat it as a new one.
                self.remove(endpoint)
                departed.append(endpoint)
                continue
            endpoint.worker_id = info.worker_id
            endpoint.model = info.model
            endpoint.draining = endpoint.draining or info.draining
        known = {e.address for e in self.endpoints}
        for address, info in live.items():
            if address not in known:
                endpoint = self.add(address, info.role, worker_id=info.worker_id,
                                    model=info.model)
                endpoint.draining = info.draining
                joined.append(endpoint)
                self._spawn(self._poll(endpoint))  # routable within one round trip
        return joined, departed

    # -- views ----------------------------------------------------------------------------------

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_addresses) or any(e.role == "prefill" for e in self.endpoints)

    def decoders(self) -> list[WorkerEndpoint]:
        return [e for e in self.endpoints if e.decode_capable]

    def prefillers(self) -> list[WorkerEndpoint]:
        return [e for e in self.endpoints if e.role == "prefill"]

    def max_model_len(self) -> int | None:
        lengths = [e.health.max_model_len for e in self.endpoints
                   if e.health is not None and e.health.max_model_len]
        return min(lengths) if lengths else None

    def block_size(self) -> int:
        sizes = [e.health.block_size for e in self.endpoints if e.health and e.health.block_size]
        return min(sizes) if sizes else 16

    # -- health polling -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.poll_once()
        self._poll_task = asyncio.create_task(self._poll_forever(), name="worker-health-poll")

    async def close(self) -> None:
        tasks = [t for t in (self._poll_task, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(e.channel.close() for e in self.endpoints + self._retiring
                               if e.channel is not None), return_exceptions=True)

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in self.endpoints))
        await self._close_idle_retired()

    async def _poll(self, endpoint: WorkerEndpoint) -> None:
        stub = endpoint.decode or endpoint.prefill
        started = time.monotonic()
        try:
            health = await stub.Health(common_pb2.HealthRequest(), timeout=self.poll_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if endpoint.reachable:
                log.warning("worker %s unreachable: %s", endpoint.address, exc.code().name)
            endpoint.mark_failed(exc.code().name)
            return
        previous = endpoint.health
        restarted = previous is not None and (health.worker_id != previous.worker_id
                                              or health.stats.steps < previous.stats.steps)
        if restarted:
            log.info("worker %s restarted in place; forgetting its prefix cache", endpoint.address)
            if self.on_cache_lost is not None:
                self.on_cache_lost(endpoint)
        if (health.status == common_pb2.HealthResponse.SERVING
                and endpoint.breaker.health_confirmed(restarted)):
            log.info("worker %s serves again: back in rotation (circuit closed)",
                     endpoint.address)
        if not endpoint.reachable or (previous is not None and previous.status != health.status):
            log.info("worker %s (%s %s) is %s", endpoint.address, health.role, health.worker_id,
                     common_pb2.HealthResponse.Status.Name(health.status))
        endpoint.health = health
        endpoint.reachable = True
        if health.status == common_pb2.HealthResponse.SERVING:
            endpoint.serving_polled_at = started
        endpoint.draining = health.status == common_pb2.HealthResponse.DRAINING
        endpoint.worker_id = health.worker_id or endpoint.worker_id
        endpoint.model = health.model or endpoint.model
        endpoint.blocks_since_poll = 0
        endpoint.requests_since_poll = 0
        endpoint.prefill_tokens_since_poll = 0

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                await self.poll_once()
            except Exception:  # a poll bug must not stop polling
                log.exception("worker health poll failed")

    async def _close_idle_retired(self) -> None:
        idle = [e for e in self._retiring if e.outstanding <= 0]
        self._retiring = [e for e in self._retiring if e.outstanding > 0]
        await asyncio.gather(*(e.channel.close() for e in idle if e.channel is not None),
                             return_exceptions=True)

    def _spawn(self, coroutine) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coroutine)
        except RuntimeError:  # no loop (building the pool before serving): the poll will come
            coroutine.close()
            return
        self._background.add(task)
        task.add_done_callback(self._background.discard)
