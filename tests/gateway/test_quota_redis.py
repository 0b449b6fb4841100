"""Quotas shared through a real redis-server: atomic check-and-take across clients, leases
that a crashed gateway cannot leak, fail-open and fail-closed while Redis is away, and
recovery on its own when it returns."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis_restart import RestartedRedis, kill

from services.gateway.admission import redis_quota
from services.gateway.admission.quota import Quotas
from services.gateway.admission.redis_quota import RedisQuota
from services.gateway.admission.tenants import Tenant
from services.gateway.errors import APIError


def test_two_gateways_never_spend_the_same_tokens(redis_server):
    tenant = Tenant("shared", tokens_per_minute=6000, burst_tokens=500)  # 100 tokens/s

    async def scenario():
        gateways = [RedisQuota(redis_server, f"gw{i}") for i in range(2)]
        admitted = 0
        start = time.monotonic()

        async def hammer(quota: RedisQuota, worker: int) -> None:
            nonlocal admitted
            for n in range(150):
                decision = await quota.acquire(tenant, 10, f"{worker}-{n}")
                admitted += 10 * decision.admitted
        await asyncio.gather(*(hammer(gateways[i % 2], i) for i in range(8)))
        elapsed = time.monotonic() - start
        for quota in gateways:
            await quota.close()
        return admitted, elapsed

    admitted, elapsed = asyncio.run(scenario())
    assert 500 <= admitted <= 500 + 100 * elapsed + 10


def test_a_crashed_gateways_slots_expire_and_a_live_ones_are_renewed(redis_server, monkeypatch):
    monkeypatch.setattr(redis_quota, "LEASE_TTL_MS", 400)
    tenant = Tenant("t", max_concurrency=2)

    async def scenario():
        alive, crashed, other = (RedisQuota(redis_server, name) for name in ("a", "c", "o"))
        assert (await alive.acquire(tenant, 1, "a1")).admitted
        alive.leases["a1"] = "t"
        assert (await crashed.acquire(tenant, 1, "c1")).admitted  # then never renewed
        assert not (await other.acquire(tenant, 1, "o1")).admitted
        for _ in range(6):
            await asyncio.sleep(0.1)
            await alive.heartbeat()
        second = await other.acquire(tenant, 1, "o1")  # the crashed gateway's slot is back ...
        third = await other.acquire(tenant, 1, "o2")  # ... the live gateway's is not
        for quota in (alive, crashed, other):
            await quota.close()
        return second.admitted, third.admitted

    assert asyncio.run(scenario()) == (True, False)


def test_fail_open_serves_on_local_limits_and_shares_again_when_redis_returns(
        redis_server_factory, tmp_path):
    server = redis_server_factory()
    tenant = Tenant("t", tokens_per_minute=60_000, burst_tokens=10_000)

    async def scenario():
        quotas = Quotas(server.url, "open")
        quotas.PROBE_INTERVAL_S = 0.1
        await quotas.start()
        assert quotas.status.shared
        quotas.release(await quotas.acquire(tenant, 100), 100)
        kill(server)
        lease = await quotas.acquire(tenant, 100)  # Redis is gone: still admitted
        assert not quotas.status.shared and lease.store is quotas.local
        quotas.release(lease, 100)
        restarted = RestartedRedis(server.port, tmp_path)
        try:
            deadline = time.monotonic() + 5
            while not quotas.status.shared:
                assert time.monotonic() < deadline, "quotas did not go back to redis"
                await asyncio.sleep(0.05)
            lease = await quotas.acquire(tenant, 100)
            client = aioredis.from_url(server.url)
            tokens = await client.hget("splitserve:quota:{t}:tokens", "tokens")
            await client.aclose()
            quotas.release(lease, 100)
            await quotas.close()
            return lease.store is quotas.redis, float(tokens), quotas.status
        finally:
            restarted.stop()

    shared_again, tokens, status = asyncio.run(scenario())
    assert shared_again and tokens == pytest.approx(9_900, abs=50)
    assert status.outages == 1 and status.fail_open_admissions == 1


def test_fail_closed_answers_503_while_redis_is_away(redis_server_factory):
    server = redis_server_factory()

    async def scenario():
        quotas = Quotas(server.url, "closed")
        await quotas.start()
        kill(server)
        with pytest.raises(APIError) as refused:
            await quotas.acquire(Tenant("t", tokens_per_minute=600), 10)
        await quotas.close()
        return refused.value

    error = asyncio.run(scenario())
    assert error.status == 503 and error.retry_after_s == 1
    assert error.code == "quota_unavailable"


def test_fail_open_gives_each_replica_its_share_of_a_limit(redis_server_factory):
    server = redis_server_factory()
    tenant = Tenant("t", tokens_per_minute=600, burst_tokens=100, max_concurrency=4)

    async def scenario():
        replicas = [Quotas(server.url, "open") for _ in range(2)]
        for quotas in replicas:
            await quotas.start()
        await replicas[0]._beat()  # both registered: each sees 2 gateways
        kill(server)
        first = await replicas[0].acquire(tenant, 50)
        with pytest.raises(APIError):
            await replicas[0].acquire(tenant, 1)  # half the bucket is this replica's
        for quotas in replicas:
            await quotas.close()
        return first.share

    assert asyncio.run(scenario()) == 0.5
