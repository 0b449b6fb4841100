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
