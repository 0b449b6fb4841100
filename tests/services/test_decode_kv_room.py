"""A remote-KV reservation that meets a full KV cache waits for room, in arrival order, instead
of failing at once with RESOURCE_EXHAUSTED (services/decode/kv_room.py): the gateway admits
from a once-a-second poll of free blocks, and a request released into a cache that is full
for a moment got a 503. A real engine (tiny random model, a 7-block pool) on the engine
loop's real thread, driven through the real DecodeServicer.Generate handler; reservations
whose KV never comes hold the blocks until their stream is closed."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from splitserve.v1 import decode_pb2

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from services.common.engine_loop import EngineLoop
from services.common.health import WorkerState
from services.decode.servicer import DecodeServicer
from tests.services.flows import greedy

pytestmark = pytest.mark.timeout(120)

THREE_BLOCKS = list(range(5, 45))  # 40 tokens: 3 blocks of 16
ONE_BLOCK = list(range(50, 60))


@pytest.fixture
def loop(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=7,
                                    num_threads=1, enable_prefix_caching=False))
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.start()
    yield loop
    # A closed stream's abort is a command the engine thread runs next: let it.
    deadline = time.monotonic() + 10
    while engine.kv.num_free_blocks != engine.kv.num_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks, "a test left blocks reserved"


class Aborted(Exception):
    def __init__(self, code, details) -> None:
        super().__init__(f"{code}: {details}")
        self.code, self.details = code, details


class _Context:
    """The parts of a grpc.aio servicer context that Generate uses."""

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise Aborted(code, details)


def reserve(servicer: DecodeServicer, rid: str, prompt: list[int]):
    """A Generate stream asking for remote KV; its first message is the reservation."""
    return servicer.Generate(decode_pb2.GenerateRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=greedy(4), remote_prefill=True),
        _Context())


async def fill(servicer: DecodeServicer) -> list:
    """Two reservations of 3 blocks: 1 of the 7 left free."""
    held = []
    for rid in ("a", "b"):
        stream = reserve(servicer, rid, THREE_BLOCKS)
        assert (await stream.__anext__()).reserved.num_blocks == 3
        held.append(stream)
    return held


def test_a_reservation_waits_for_blocks_to_free_and_then_gets_them(loop):
    servicer = DecodeServicer(loop, "127.0.0.1:1", WorkerState("decode", "d", "tiny"), 30.0)

    async def scenario() -> None:
        a, b = await fill(servicer)
        c = reserve(servicer, "c", THREE_BLOCKS)
        waiting = asyncio.ensure_future(c.__anext__())
        await asyncio.sleep(0.5)
        assert not waiting.done(), waiting  # before: RESOURCE_EXHAUSTED at once
        assert servicer.kv_room.waiting == 1
        assert loop.stats["reservations_waiting"] == 1
        await a.aclose()  # its caller went away: 3 blocks free
        assert (await asyncio.wait_for(waiting, 10)).reserved.num_blocks == 3
        assert servicer.kv_room.waiting == 0
        for stream in (b, c):
            await stream.aclose()

    asyncio.run(scenario())


def test_waiters_are_served_in_arrival_order_and_a_newcomer_queues_behind_them(loop):
    servicer = DecodeServicer(loop, "127.0.0.1:1", WorkerState("decode", "d", "tiny"), 30.0)

    async def scenario() -> None:
        a, b = await fill(servicer)
        c = reserve(servicer, "c", THREE_BLOCKS)
        first = asyncio.ensure_future(c.__anext__())
        await asyncio.sleep(0.2)
        # One block is free and this needs one, but "c" came first.
        d = reserve(servicer, "d", ONE_BLOCK)
        second = asyncio.ensure_future(d.__anext__())
        await asyncio.sleep(0.5)
        assert not first.done() and not second.done()
        assert servicer.kv_room.waiting == 2
        await a.aclose()
        assert (await asyncio.wait_for(first, 10)).reserved.num_blocks == 3
        assert (await asyncio.wait_for(second, 10)).reserved.num_blocks == 1
        for stream in (b, c, d):
            await stream.aclose()

    asyncio.run(scenario())


def test_a_wait_ends_with_resource_exhausted_after_the_kv_wait_timeout(loop):
    servicer = DecodeServicer(loop, "127.0.0.1:1", WorkerState("decode", "d", "tiny"), 0.6)

    async def scenario() -> Aborted:
        held = await fill(servicer)
        started = asyncio.get_running_loop().time()
        with pytest.raises(Aborted) as refused:
            await reserve(servicer, "c", THREE_BLOCKS).__anext__()
        assert 0.6 <= asyncio.get_running_loop().time() - started < 5
        assert servicer.kv_room.waiting == 0
        for stream in held:
            await stream.aclose()
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 KV blocks needed, 1 free after waiting" in refused.details, refused.details


def test_a_prompt_larger_than_the_whole_cache_is_refused_without_waiting(loop):
    servicer = DecodeServicer(loop, "127.0.0.1:1", WorkerState("decode", "d", "tiny"), 30.0)

    async def scenario() -> Aborted:
        with pytest.raises(Aborted) as refused:
            await asyncio.wait_for(
                reserve(servicer, "huge", list(range(8 * 16))).__anext__(), 5)
        return refused.value

    refused = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "8 KV blocks needed, 7 in the whole cache" in refused.details, refused.details


def test_a_worker_that_starts_draining_sends_its_waiters_elsewhere(loop):
    worker = WorkerState("decode", "d", "tiny")
    servicer = DecodeServicer(loop, "127.0.0.1:1", worker, 30.0)

    async def scenario() -> Aborted:
        held = await fill(servicer)
        waiting = asyncio.ensure_future(reserve(servicer, "c", THREE_BLOCKS).__anext__())
        await asyncio.sleep(0.3)
        worker.draining = True
        with pytest.raises(Aborted) as refused:
            await asyncio.wait_for(waiting, 5)
        for stream in held:
            await stream.aclose()
        return refused.value

    # UNAVAILABLE: the gateway retries it on another worker before any token is out.
    assert asyncio.run(scenario()).code == grpc.StatusCode.UNAVAILABLE


def test_the_wait_bound_counts_the_time_in_line_behind_others(loop):
    servicer = DecodeServicer(loop, "127.0.0.1:1", WorkerState("decode", "d", "tiny"), 1.0)

    async def timed(rid: str):
        clock = asyncio.get_running_loop().time
        started = clock()
        try:
            await reserve(servicer, rid, THREE_BLOCKS).__anext__()
        except Aborted as refused:
            return refused, clock() - started
        raise AssertionError(f"{rid} got room")

    async def scenario() -> list:
        held = await fill(servicer)
        first = asyncio.ensure_future(timed("c"))
        await asyncio.sleep(0.5)
        second = asyncio.ensure_future(timed("d"))
        outcomes = await asyncio.gather(first, second)
        for stream in held:
            await stream.aclose()
        return outcomes

    (first, first_s), (second, second_s) = asyncio.run(scenario())
    assert first.code == second.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    # "d" gives up a second after it came (at 1.5 s), not a second after "c" let it try (2 s,
    # 1.5 s after it came).
    assert 0.9 <= first_s < 1.4 and 0.9 <= second_s < 1.4, (first_s, second_s)
