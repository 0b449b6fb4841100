"""The Redis users of docs/redis-users.acl, loaded into a real Redis: each role does its whole job
through the real client code (a worker registers and publishes prefix events, a gateway follows
the registry and takes quota, the autoscaler lists workers) and nothing else: a gateway cannot
register a worker, a worker cannot touch quotas, nobody can flush or reconfigure Redis."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from services.autoscaler.sources import RegistrySource
from services.common.registry import PREFIX_STREAM, RegistryPublisher, WorkerInfo, scan_workers
from services.gateway.admission.redis_quota import RedisQuota
from services.gateway.admission.tenants import Tenant

ACL_FILE = Path(__file__).resolve().parents[2] / "docs" / "redis-users.acl"
SECRET = b"acl-test-secret-0123456789"
ROLES = ("worker", "gateway", "autoscaler")


@pytest.fixture
def urls(redis_server: str) -> dict[str, str]:
    admin = redis.Redis.from_url(redis_server)
    for line in ACL_FILE.read_text().splitlines():
        if line.startswith("user "):
            _, name, *rules = line.split()
            role = name.removeprefix("splitserve-")
            rules = [f">pw-{role}" if r == f">{role.upper()}_PASSWORD" else r for r in rules]
            admin.execute_command("ACL", "SETUSER", name, "reset", *rules)
    host = redis_server.removeprefix("redis://")
    return {role: f"redis://splitserve-{role}:pw-{role}@{host}" for role in ROLES}


def _info() -> WorkerInfo:
    return WorkerInfo(worker_id="d1", role="decode", address="127.0.0.1:1", kv_endpoint="127.0.0.1:2",
                      model="m", block_size=16, max_model_len=2048)


def _denied(url: str, *command) -> bool:
    try:
        redis.Redis.from_url(url).execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_each_role_does_its_job_and_nothing_more(urls):
    async def run() -> None:
        publisher = RegistryPublisher(urls["worker"], _info, lambda: [("stored", 7), ("stored", 8)],
                                      secret=SECRET)
        await publisher.publish_once()

        gateway = aioredis.from_url(urls["gateway"])
        workers, rejected = await scan_workers(gateway, SECRET)
        assert [w.worker_id for w in workers] == ["d1"] and rejected == {}
        events = await gateway.xread({PREFIX_STREAM: "0-0"})
        assert events[0][1][0][1][b"hashes"] == b"7,8"
        quota = RedisQuota(urls["gateway"], "g1")
        tenant = Tenant(name="t", tokens_per_minute=60_000, max_concurrency=2)
        assert (await quota.acquire(tenant, 100, "lease-1")).admitted
        assert await quota.heartbeat() == 1
        await quota.release(tenant, "lease-1", 50)
        await quota.client.aclose()
        await gateway.aclose()

        await publisher.deregister("d1")  # the worker removes its own entry

    asyncio.run(run())
    assert RegistrySource(urls["autoscaler"]).workers() == []
    redis.Redis.from_url(urls["worker"]).set("splitserve:worker:d2", _info().to_json(SECRET))
    assert [w.worker_id for w in RegistrySource(urls["autoscaler"]).workers()] == ["d1"]

    forged = WorkerInfo(**{**_info().__dict__, "updated": time.time()}).to_json()
    assert _denied(urls["gateway"], "SET", "splitserve:worker:evil", forged)
    assert _denied(urls["gateway"], "XADD", PREFIX_STREAM, "*", "worker", "d1", "kind", "stored",
                   "hashes", "1")
    assert _denied(urls["autoscaler"], "SET", "splitserve:worker:evil", forged)
    assert _denied(urls["autoscaler"], "XREAD", "STREAMS", PREFIX_STREAM, "0-0")
    assert _denied(urls["worker"], "HSET", "splitserve:quota:{t}:tokens", "tokens", "1e9")
    assert _denied(urls["worker"], "XREAD", "STREAMS", PREFIX_STREAM, "0-0")
    for role in ROLES:
        assert _denied(urls[role], "FLUSHALL")
        assert _denied(urls[role], "CONFIG", "SET", "appendonly", "yes")
        assert _denied(urls[role], "SET", "unrelated", "1")
