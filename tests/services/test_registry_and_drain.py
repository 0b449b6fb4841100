"""Workers register in a real Redis with an expiring heartbeat and publish prefix-cache
events; SIGTERM drains: deregister, refuse new work, finish what is held, exit cleanly."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
import redis
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from services.common.registry import PREFIX_STREAM, WORKER_KEY, decode_entry
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
        info = decode_entry(key, r.get(key), None)
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


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny model with a long context, so a held stream outlives the drain checks."""
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-long"), arch="llama", seed=0,
                            max_position_embeddings=2048)


def test_sigterm_finishes_held_streams_and_refuses_new_ones(long_model):
    """The late request is sent once the worker reports DRAINING, while the held stream is
    still generating (1,500 tokens: a fixed sleep raced a fast machine, where a short held
    stream ended first and the late RPC met the server shutting down instead)."""
    held_tokens = 1500
    worker = start_worker("both", long_model, "--num-kv-blocks", "256")
    try:
        async def run():
            async with grpc.aio.insecure_channel(worker.address) as ch:
                stub = decode_pb2_grpc.DecodeStub(ch)
                stream = stub.Generate(decode_pb2.GenerateRequest(
                    request_id="held", prompt_token_ids=[5, 6, 7],
                    sampling=greedy(held_tokens)))
                first = await stream.read()
                worker.process.send_signal(signal.SIGTERM)
                await asyncio.to_thread(
                    worker.wait_for,
                    lambda h: h.status == common_pb2.HealthResponse.DRAINING,
                    what="DRAINING")
                late = stub.Generate(decode_pb2.GenerateRequest(
                    request_id="late", prompt_token_ids=[5, 6, 7], sampling=greedy(3)))
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await late.read()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
                assert "draining" in err.value.details()
                return await read_deltas(stream, list(first.delta.token_ids))

        assert len(asyncio.run(run())) == held_tokens
        worker.process.wait(30)
        assert worker.process.returncode == 0
    finally:
        worker.kill()
