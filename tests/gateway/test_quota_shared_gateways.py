"""Two gateway processes sharing one redis-server enforce one tenant's token rate together, keep
serving (fail-open, local limits) when Redis is killed, and share again once it restarts."""

from __future__ import annotations

import asyncio
import time

import redis
from redis_restart import RestartedRedis, kill
from tenant_load import ClosedLoop, metric, tenants_file

RATE_PER_S = 100  # tokens per second for the tenant, across both gateways
WINDOW_S = 12.0


def _gateways(gateway_factory, disagg_workers, tmp_path, redis_url: str):
    prefill, decode = disagg_workers
    path = tenants_file(tmp_path, {"shared": {"tokens_per_minute": RATE_PER_S * 60,
                                              "burst_tokens": 200}})
    return [gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                            "--redis-url", redis_url, "--tenants-file", path)
            for _ in range(2)]


async def _admitted_over_window(load: ClosedLoop, warmup_s: float = 2.0) -> tuple[int, float]:
    """Tokens admitted across the gateways in a window after the burst allowance is spent."""
    await asyncio.sleep(warmup_s)
    start = time.monotonic()
    await asyncio.sleep(WINDOW_S)
    return load.admitted_tokens(start, time.monotonic()), time.monotonic() - start


def test_two_gateways_enforce_one_token_rate_together(gateway_factory, disagg_workers, tmp_path,
                                                      redis_server, tiny_llama_dir):
    gateways = _gateways(gateway_factory, disagg_workers, tmp_path, redis_server)
    urls = [f"http://{g.address}" for g in gateways]

    async def scenario():
        load = ClosedLoop(urls, tiny_llama_dir.name, "sk-shared").start()
        admitted, window = await _admitted_over_window(load)
        await load.stop()
        return load, admitted, window

    load, admitted, window = asyncio.run(scenario())
    limit = RATE_PER_S * window
    assert abs(admitted - limit) <= 0.1 * limit, (admitted, limit)
    # Both gateways admitted part of it, and refused the rest with 429 + Retry-After.
    for url in urls:
        assert any(o.status == 200 and o.gateway == url for o in load.outcomes)
    assert {o.status for o in load.outcomes} == {200, 429}


def test_gateways_serve_through_a_redis_outage_and_share_again_after(
        gateway_factory, disagg_workers, tmp_path, redis_server_factory, tiny_llama_dir):
    server = redis_server_factory()
    gateways = _gateways(gateway_factory, disagg_workers, tmp_path, server.url)
    urls = [f"http://{g.address}" for g in gateways]
    restarted: list[RestartedRedis] = []

    async def scenario():
        load = ClosedLoop(urls, tiny_llama_dir.name, "sk-shared").start()
        await asyncio.sleep(2)
        kill(server)
        outage_start = time.monotonic()
        await asyncio.sleep(6)
        outage = [o for o in load.outcomes if o.sent_at >= outage_start + 1]
        shared_during = [metric(url, "splitserve_gateway_quota_shared") for url in urls]
        restarted.append(RestartedRedis(server.port, tmp_path))
        deadline = time.monotonic() + 15
        while any(metric(url, "splitserve_gateway_quota_shared") != 1 for url in urls):
            assert time.monotonic() < deadline, "the gateways did not go back to redis"
            await asyncio.sleep(0.2)
        admitted, window = await _admitted_over_window(load)
        await load.stop()
        return outage, shared_during, admitted, window

    try:
        outage, shared_during, admitted, window = asyncio.run(scenario())
        # Fail-open: still serving while Redis was down, each gateway on its half of the limit.
        assert shared_during == [0, 0]
        assert sum(o.status == 200 for o in outage) >= 10
        assert {o.status for o in outage} <= {200, 429}
        outage_tokens = sum(o.tokens for o in outage if o.status == 200)
        assert outage_tokens <= 1.5 * RATE_PER_S * 5 + 2 * 200
        for url in urls:
            assert metric(url, "splitserve_gateway_quota_redis_outages_total") == 1
            assert metric(url, "splitserve_gateway_quota_fail_open_admissions_total") > 0
        # Shared again: the bucket lives in Redis and the two gateways together hold the rate.
        assert redis.Redis(port=server.port).exists("splitserve:quota:{shared}:tokens")
        limit = RATE_PER_S * window
        assert abs(admitted - limit) <= 0.1 * limit, (admitted, limit)
    finally:
        for process in restarted:
            process.stop()
