"""The worker pool following registry entries: joins and departures, static workers kept,
a new worker at a known address treated as new, and departed workers' prefix cache forgotten."""

from __future__ import annotations

import asyncio

from services.common.registry import WorkerInfo
from services.gateway.routing.worker_pool import WorkerPool


def info(worker_id: str, role: str, port: int, **kw) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"127.0.0.1:{port}",
                      kv_endpoint="", model=kw.pop("model", "m"), block_size=16,
                      max_model_len=512, **kw)


def test_registry_entries_join_and_leave_and_static_workers_stay():
    async def run():
        lost = []
        pool = WorkerPool(decode_addresses=["127.0.0.1:1"], on_cache_lost=lost.append)
        joined, departed = pool.apply_registry([info("p1", "prefill", 2), info("d2", "decode", 3)])
        assert [e.worker_id for e in joined] == ["p1", "d2"] and not departed
        assert {e.address for e in pool.endpoints} == {"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}
        joined, departed = pool.apply_registry([info("d2", "decode", 3)])
        assert not joined and [e.worker_id for e in departed] == ["p1"]
        assert [e.worker_id for e in lost] == ["p1"]
        assert {e.address for e in pool.endpoints} == {"127.0.0.1:1", "127.0.0.1:3"}
        # Another worker now answers at d2's address: the old endpoint goes, a new one comes.
        old = pool.find("127.0.0.1:3")
        joined, departed = pool.apply_registry([info("d9", "decode", 3, model="m-v2")])
        assert departed == [old] and joined[0].worker_id == "d9" and joined[0].model == "m-v2"
        await pool.close()

    asyncio.run(run())


def test_a_worker_still_holding_requests_keeps_its_channel_until_they_end():
    async def run():
        pool = WorkerPool()
        (endpoint,), _ = pool.apply_registry([info("d1", "decode", 4)])
        endpoint.outstanding = 1
        pool.apply_registry([])
        await pool.poll_once()
        assert endpoint in pool._retiring  # not closed under its open streams
        endpoint.outstanding = 0
        await pool.poll_once()
        assert endpoint not in pool._retiring
        await pool.close()

    asyncio.run(run())


def test_a_serving_worker_whose_entry_vanished_stays_for_the_grace():
    """A Redis restarted empty loses every entry until the next heartbeats: workers whose
    health check still says SERVING stay (before, every worker left and the gateway answered
    503 for about a second); one that is not serving, or missing past the grace, leaves."""
    from splitserve.v1 import common_pb2

    async def run():
        pool = WorkerPool(registry_grace_s=0.3)
        (serving, gone), _ = pool.apply_registry([info("d1", "decode", 5), info("d2", "decode", 6)])
        serving.reachable, serving.health = True, common_pb2.HealthResponse(
            status=common_pb2.HealthResponse.SERVING)
        _, departed = pool.apply_registry([])  # Redis came back empty
        assert departed == [gone] and pool.endpoints == [serving]
        _, departed = pool.apply_registry([info("d1", "decode", 5)])  # its next heartbeat
        assert not departed and serving.missing_since is None
        pool.apply_registry([])
        await asyncio.sleep(0.35)
        _, departed = pool.apply_registry([])  # missing past the grace: gone for good
        assert departed == [serving] and not pool.endpoints
        await pool.close()

    asyncio.run(run())
