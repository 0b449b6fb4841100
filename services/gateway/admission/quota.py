"""Per-tenant quotas: a token bucket (prompt + generated tokens) and a concurrency counter.

A request is charged its prompt plus its whole `max_tokens` when admitted and refunded what it
did not generate when it ends. With a Redis URL the counters are shared by every gateway
replica (redis_quota.py); without one, or while Redis is unreachable under fail-open, they
live in this process. Owned by the gateway's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from dataclasses import dataclass

from services.gateway.admission.quota_store import Decision, QuotaStore
from services.gateway.admission.redis_quota import RedisQuota
from services.gateway.admission.retry_after import RetrySchedule
from services.gateway.admission.tenants import Tenant
from services.gateway.errors import APIError

log = logging.getLogger(__name__)

FAIL_MODES = ("open", "closed")


@dataclass
class QuotaRefused(APIError):
    """A 429 (or a fail-closed 503) from the quota; `reason` names the limit, for metrics."""

    reason: str = ""


@dataclass
class _Bucket:
    tokens: float
    at: float


class LocalQuota:
    """In-process buckets and counters, for one gateway."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._leases: dict[str, set[str]] = {}

    def _refill(self, tenant: Tenant, share: float) -> _Bucket:
        size = tenant.bucket_size * share
        now = self._clock()
        bucket = self._buckets.setdefault(tenant.name, _Bucket(size, now))
        bucket.tokens = min(size, bucket.tokens + (now - bucket.at) * tenant.tokens_per_s * share)
        bucket.at = now
        return bucket

    def take(self, tenant: Tenant, tokens: int, lease_id: str, share: float = 1.0) -> Decision:
        leases = self._leases.setdefault(tenant.name, set())
        if tenant.max_concurrency and len(leases) >= max(1, math.ceil(tenant.max_concurrency * share)):
            return Decision(False, "concurrency", 1.0)
        if tenant.tokens_per_minute:
            bucket = self._refill(tenant, share)
            if bucket.tokens < tokens:
                return Decision(False, "tokens",
                                (tokens - bucket.tokens) / (tenant.tokens_per_s * share))
            bucket.tokens -= tokens
        if tenant.max_concurrency:
            leases.add(lease_id)
        return Decision(True)

    def give(self, tenant: Tenant, lease_id: str, refund: int, share: float = 1.0) -> None:
        leases = self._leases.get(tenant.name)
        if leases is not None:
            leases.discard(lease_id)
            if not leases:
                del self._leases[tenant.name]
        if refund > 0 and tenant.tokens_per_minute:
            bucket = self._refill(tenant, share)
            bucket.tokens = min(tenant.bucket_size * share, bucket.tokens + refund)

    async def acquire(self, tenant: Tenant, tokens: int, lease_id: str,
                      share: float = 1.0) -> Decision:
        return self.take(tenant, tokens, lease_id, share)

    async def release(self, tenant: Tenant, lease_id: str, refund: int,
                      share: float = 1.0) -> None:
        self.give(tenant, lease_id, refund, share)


@dataclass(eq=False)
class Lease:
    """One admitted request's hold on its tenant's quota; `Quotas.release` it once."""

    lease_id: str
    tenant: Tenant
    tokens: int  # charged at admission
    store: QuotaStore | None  # where it was taken (None: the tenant has no quota)
    share: float = 1.0


@dataclass
class QuotaStatus:
    """What /metrics and the logs say about the quota backend."""

    shared: bool = False  # counters live in Redis right now
    outages: int = 0
    fail_open_admissions: int = 0
    fail_closed_rejections: int = 0
    replicas: int = 1  # gateways seen in Redis at the last heartbeat


class Quotas:
    """The quota front the admission path uses: Redis when configured and reachable, else the
    fail mode decides (open: this replica's share of each limit, in process; closed: 503).
    A probe brings Redis back on its own once it answers again."""

    PROBE_INTERVAL_S = 0.5
    HEARTBEAT_INTERVAL_S = 2.0

    def __init__(self, redis_url: str = "", fail_mode: str = "open",
                 redis_timeout_s: float = 0.5) -> None:
        if fail_mode not in FAIL_MODES:
            raise ValueError(f"quota fail mode must be one of {FAIL_MODES}, got {fail_mode!r}")
        self.fail_mode = fail_mode
        self.gateway_id = f"gw-{uuid.uuid4().hex[:12]}"
        self.local = LocalQuota()
        self.redis = None
        if redis_url:
            self.redis = RedisQuota(redis_url, self.gateway_id, timeout_s=redis_timeout_s)
        self.status = QuotaStatus(shared=self.redis is not None)
        self._ids = itertools.count()
        # Per tenant: when its token-refused clients may come back, spread by what each needs
        # (see acquire). Bounded by the tenants known.
        self._comebacks: dict[str, RetrySchedule] = {}
        self._task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        if self.redis is None:
            return
        try:
            await self._beat()
            log.info("quotas shared through redis (%d gateways)", self.status.replicas)
        except Exception as exc:  # noqa: BLE001 - any Redis failure means "not shared now"
            self._lost(exc)
        self._task = asyncio.create_task(self._maintain(), name="quota-redis")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.redis is not None:
            await self.redis.close()

    async def acquire(self, tenant: Tenant, tokens: int) -> Lease:
        """Charge `tokens` and take a slot; raises APIError 429 (over quota) or 503 (Redis
        down under fail-closed)."""
        if not (tenant.tokens_per_minute or tenant.max_concurrency):
            return Lease("", tenant, tokens, None)
        if tenant.tokens_per_minute and tokens > tenant.bucket_size:
            raise QuotaRefused(
                429, f"This request needs {tokens} tokens (prompt + max_tokens), more than "
                     f"tenant {tenant.name}'s limit of {tenant.bucket_size} tokens at once; "
                     "lower max_tokens or shorten the prompt.",
                "rate_limit_error", "max_tokens", "request_exceeds_token_limit",
                # Never served as it is: the OpenAI SDK retries a 429 twice unless told not to.
                should_retry=False, reason="quota_tokens")
        lease_id = f"{self.gateway_id}:{next(self._ids)}"
        store, share = await self._store()
        try:
            decision = await store.acquire(tenant, tokens, lease_id, share)
        except Exception as exc:  # noqa: BLE001
            if store is self.local:
                raise
            self._lost(exc)
            store, share = await self._store()
            decision = await store.acquire(tenant, tokens, lease_id, share)
        comeback = self._comebacks.get(tenant.name)
        if not decision.admitted:
            retry_s = decision.retry_after_s
            if decision.reason == "tokens" and tenant.tokens_per_s:
                # The bucket refills for one of them at a time: told the same "retry in 2 s",
                # 7 of a burst's refused requests came back together and 6 were refused
                # again. Each is told when the tokens of those told before it will have come.
                comeback = self._comebacks.setdefault(tenant.name, RetrySchedule())
                retry_s = comeback.retry_after_s(retry_s, tokens / tenant.tokens_per_s)
            raise _over_quota(tenant, decision, retry_s)
        if comeback is not None:
            comeback.room()
        if store is self.redis:
            self.redis.leases[lease_id] = tenant.name
        elif self.redis is not None:
            self.status.fail_open_admissions += 1
        return Lease(lease_id, tenant, tokens, store, share)

    def release(self, lease: Lease, used_tokens: int) -> None:
        """Return the slot and refund `lease.tokens - used_tokens`; never blocks the caller."""
        if lease.store is None:
            return
        refund = max(0, lease.tokens - used_tokens)
        if lease.store is self.local:
            self.local.give(lease.tenant, lease.lease_id, refund, lease.share)
            return
        self.redis.leases.pop(lease.lease_id, None)
        self._keep(asyncio.ensure_future(self._release_shared(lease, refund)))

    async def _release_shared(self, lease: Lease, refund: int) -> None:
        try:
            await self.redis.release(lease.tenant, lease.lease_id, refund, lease.share)
        except Exception as exc:  # noqa: BLE001 - the lease expires in Redis on its own
            self._lost(exc)

    async def _store(self) -> tuple[QuotaStore, float]:
        if self.redis is None:
            return self.local, 1.0
        if self.status.shared:
            return self.redis, 1.0
        if self.fail_mode == "closed":
            self.status.fail_closed_rejections += 1
            raise QuotaRefused(
                503, "Quota service unavailable (Redis is unreachable and this gateway fails "
                     "closed); retry.", "server_error", None, "quota_unavailable", 1,
                reason="quota_unavailable")
        return self.local, 1.0 / max(1, self.status.replicas)

    def _lost(self, exc: BaseException) -> None:
        if not self.status.shared:
            return
        self.status.shared = False
        self.status.outages += 1
        log.warning("redis unreachable for quotas (%s: %s); failing %s%s", type(exc).__name__,
                    exc, self.fail_mode,
                    f" with 1/{self.status.replicas} of each limit per replica"
                    if self.fail_mode == "open" else ": 503 until it returns")

    async def _beat(self) -> None:
        self.status.replicas = await self.redis.heartbeat()

    async def _maintain(self) -> None:
        """Heartbeat (replica count, lease renewal) while shared; probe while not."""
        while True:
            shared = self.status.shared
            await asyncio.sleep(self.HEARTBEAT_INTERVAL_S if shared else self.PROBE_INTERVAL_S)
            try:
                if not shared:
                    await self.redis.reconnect()
                await self._beat()
            except Exception as exc:  # noqa: BLE001
                self._lost(exc)
                continue
            if not self.status.shared:
                self.status.shared = True
                log.info("redis is back: quotas shared again (%d gateways)",
                         self.status.replicas)

    def _keep(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _over_quota(tenant: Tenant, decision: Decision, retry_s: float) -> QuotaRefused:
    retry = max(1, math.ceil(retry_s))
    if decision.reason == "concurrency":
        message = (f"Tenant {tenant.name} has {tenant.max_concurrency} requests in flight, its "
                   "limit; retry when one finishes.")
    else:
        message = (f"Rate limit reached for tenant {tenant.name}: {tenant.tokens_per_minute} "
                   f"tokens per minute (prompt + max_tokens). Retry in {retry}s.")
    return QuotaRefused(429, message, "rate_limit_error", None, "rate_limit_exceeded", retry,
                        reason=f"quota_{decision.reason}")
