"""Workers register in a real Redis with an expiring heartbeat and publish prefix-cache
events; SIGTERM drains: deregister, refuse new work, finish what is held, exit cleanly."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import redis
from splitserve.v1 import decode_pb2, decode_pb2_grpc

from services.common.registry import PREFIX_STREAM, WORKER_KEY, WorkerInfo
from splitserve_cli.processes import start_worker
from tests.services.flows import aggregated, greedy, read_deltas

pytestmark = pytest.mark.timeout(180)


def wait_until(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached")
        time.sleep(0.05)


def test_worker_registers_publishes_prefix_events_and_deregisters(tiny_llama_dir, redis_server):
    r = redis.Redis.from_url(redis_server)
    worker = start_worker("both", tiny_llama_dir, "--num-kv-blocks", "64",
                          "--redis-url", redis_server, "--heartbeat-ttl-s", "2")
    try:
        key = WORKER_KEY + worker.health().worker_id
        wait_until(lambda: r.get(key) is not None, what="registration")
        info = WorkerInfo.from_json(r.get(key))
        assert info.role == "both" and info.address == worker.address
        assert info.kv_endpoint == worker.kv_endpoint
        assert info.stats["kv_blocks_total"] == 64
        assert 0 < r.pttl(key) <= 2000

        asyncio.run(aggregated(worker.address, "cached", list(range(10, 60)), greedy(4)))
        def stored_hashes():
            entries = r.xrange(PREFIX_STREAM)
            return [h for _, f in entries if f[b"kind"] == b"stored"
                    for h in f[b"hashes"].split(b",")]
        wait_until(lambda: len(stored_hashes()) >= 3, what="prefix events")  # 53 tokens: 3 blocks

        worker.kill(signal.SIGTERM)
        assert worker.process.returncode == 0, worker.output
        assert r.get(key) is None
    finally:
        worker.kill()


def test_sigterm_finishes_held_streams_and_refuses_new_ones(tiny_llama_dir):
    worker = start_worker("both", tiny_llama_dir, "--num-kv-blocks", "64")
    try:
        async def run():
            async with grpc.aio.insecure_channel(worker.address) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                stream = stub.Generate(decode_pb2.GenerateRequest(
                    request_id="held", prompt_token_ids=[5, 6, 7], sampling=greedy(300)))
                first = await stream.read()
                worker.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                late = stub.Generate(decode_pb2.GenerateRequest(
                    request_id="late", prompt_token_ids=[5, 6, 7], sampling=greedy(3)))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await late.read()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                tokens = await read_deltas(stream, list(first.delta.token_ids))
                return tokens

        assert len(asyncio.run(run())) == 300
        worker.process.wait(20)
        assert worker.process.returncode == 0
    finally:
        worker.kill()
