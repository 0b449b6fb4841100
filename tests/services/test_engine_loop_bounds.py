"""The engine loop leaves nothing behind in any cancellation window and bounds what it holds:
an open cancelled while its start command waits, a reservation whose KV never comes, a reader
that stops reading, a Generate stream closed at a yield, and a step that hangs. A real engine
(tiny random model) on the loop's real thread; the engine thread is held busy with a command
that waits on an event, so every window is hit deterministically, not by timing."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import pytest
from splitserve.v1 import common_pb2, decode_pb2

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop
from services.common.health import WorkerState, health_response
from services.decode.servicer import DecodeServicer
from tests.services.flows import greedy

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks of 16
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, seed=7)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    """One engine for the module; each test gets its own loop over it and leaves it idle."""
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
                                  num_threads=1))


@pytest.fixture
def make_loop(engine):
    loops: list[EngineLoop] = []

    def make(**kwargs) -> EngineLoop:
        loop = EngineLoop(engine, idle_wait_s=0.01, **kwargs)
        loops.append(loop)
        loop.start()
        return loop

    yield make
    for loop in loops:
        loop.stop()
    assert not engine.has_unfinished(), "a test left work in the engine"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def hold_engine_thread(loop: EngineLoop) -> threading.Event:
    """Keep the engine thread inside one command until the returned event is set."""
    gate = threading.Event()
    entered = threading.Event()

    def hold(engine) -> None:
        entered.set()
        gate.wait(30)

    loop.submit(hold)
    assert entered.wait(10)
    return gate


def leftovers(stats: dict) -> dict:
    keys = ("running", "waiting", "waiting_for_kv")
    left = {k: stats[k] for k in keys if stats[k]}
    if stats["kv_blocks_free"] != stats["kv_blocks_total"]:
        left["kv_blocks_used"] = stats["kv_blocks_total"] - stats["kv_blocks_free"]
    return left


START = {
    "decode reservation": lambda rid: lambda e: e.remote.reserve(rid, PROMPT, PARAMS),
    "prefill with held KV": lambda rid: lambda e: e.add_request(
        rid, PROMPT, dataclasses.replace(PARAMS, max_tokens=1), hold_kv=True),
    "aggregated request": lambda rid: lambda e: e.add_request(rid, PROMPT, PARAMS),
}


@pytest.mark.parametrize("kind", sorted(START))
def test_cancel_while_open_is_pending_leaves_nothing(make_loop, kind):
    loop = make_loop()

    async def scenario() -> dict:
        gate = hold_engine_thread(loop)
        opening = asyncio.ensure_future(loop.open("cut", START[kind]("cut")))
        await asyncio.sleep(0)  # open has queued its start command behind the held one
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        gate.set()  # start now runs, for a caller that is gone
        # Queued after everything above, so it sees the state they left.
        return await loop.call(lambda e: {**e.stats(), "streams": len(loop._streams)})

    stats = asyncio.run(scenario())
    assert leftovers(stats) == {} and stats["streams"] == 0, stats


def test_cancelled_open_of_an_id_in_use_leaves_the_live_request_alone(make_loop):
    loop = make_loop()

    async def scenario() -> list[int]:
        stream, _ = await loop.open("twin", START["aggregated request"]("twin"))
        gate = hold_engine_thread(loop)
        second = asyncio.ensure_future(loop.open("twin", START["aggregated request"]("twin")))
        await asyncio.sleep(0)
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        gate.set()
        tokens: list[int] = []
        while True:
            out = await stream.get()
            tokens += out.new_token_ids
            if out.finished:
                assert out.finish_reason == "length", out
                return tokens

    assert len(asyncio.run(scenario())) == PARAMS.max_tokens


def test_unclaimed_reservation_is_freed_after_its_ttl(make_loop):
    loop = make_loop(kv_reservation_ttl_s=0.3)

    async def scenario() -> None:
        # Reserved with no stream at all: nobody will read it, nobody recomputes it.
        await loop.call(lambda e: e.remote.reserve("orphan", PROMPT, PARAMS))
        assert loop.engine.scheduler.waiting_for_kv
        deadline = time.monotonic() + 20
        while leftovers(await loop.call(lambda e: e.stats())):
            assert time.monotonic() < deadline, "the reservation was never freed"
            await asyncio.sleep(0.05)

    asyncio.run(scenario())


def test_reservation_with_an_open_stream_is_recomputed_after_its_ttl(make_loop, engine):
    want = engine.generate([PROMPT], PARAMS)[0].token_ids  # before a loop thread owns it
    loop = make_loop(kv_reservation_ttl_s=0.3)

    async def scenario() -> list[int]:
        stream, _ = await loop.open("late", START["decode reservation"]("late"))
        tokens: list[int] = []
        while True:
            out = await asyncio.wait_for(stream.get(), 30)
            tokens += out.new_token_ids
            if out.finished:
                return tokens

    assert asyncio.run(scenario()) == want


def test_reader_that_stops_reading_is_cut_off(make_loop):
    loop = make_loop(max_unread_outputs=4)

    async def scenario() -> list:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, seed=7)
        stream, _ = await loop.open("stuck", lambda e: e.add_request("stuck", PROMPT, long))
        deadline = time.monotonic() + 30
        while leftovers(await loop.call(lambda e: e.stats())):  # the reader never reads
            assert time.monotonic() < deadline, "the unread request kept running"
            await asyncio.sleep(0.05)
        return [stream.queue.get_nowait() for _ in range(stream.queue.qsize())]

    outputs = asyncio.run(scenario())
    assert [len(o.new_token_ids) for o in outputs[:4]] == [1, 1, 1, 1]
    assert len(outputs) == 5, [o.finish_reason for o in outputs]
    last = outputs[-1]
    assert last.finished and last.finish_reason == "error" and "behind" in last.error


class _Context:
    """The parts of a grpc.aio servicer context that Generate uses."""

    def invocation_metadata(self):
        return ()

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def test_generate_closed_at_a_yield_frees_its_reservation_at_once(make_loop):
    loop = make_loop()
    servicer = DecodeServicer(loop, "127.0.0.1:1", WorkerState("decode", "d", "tiny"), 60.0)

    async def scenario() -> dict:
        messages = servicer.Generate(decode_pb2.GenerateRequest(
            request_id="closed", prompt_token_ids=PROMPT, sampling=greedy(8),
            remote_prefill=True), _Context())
        first = await messages.__anext__()
        assert first.reserved.num_blocks == 3
        await messages.aclose()  # what grpc does to a handler whose caller went away
        assert len(servicer.kv_keys) == 0
        # Queued right now: it runs after an abort queued by the close, not one left for
        # the garbage collector to schedule later.
        return await loop.call(lambda e: e.stats())

    stats = asyncio.run(scenario())
    assert leftovers(stats) == {}, stats


def test_watchdog_reports_a_stuck_step_and_what_it_held(make_loop, engine, caplog,
                                                         monkeypatch):
    loop = make_loop(step_timeout_s=0.2)
    worker = WorkerState("both", "w", "tiny")
    gate = threading.Event()
    entered = threading.Event()
    real_execute = engine.runner.execute_model

    def stuck_execute(sched, *args):
        entered.set()
        gate.wait(30)  # like a gloo/NCCL wait on a peer that does not answer
        return real_execute(sched, *args)

    monkeypatch.setattr(engine.runner, "execute_model", stuck_execute)
    rid = "watched-" + "x" * 100

    async def scenario() -> list[int]:
        assert health_response(loop, worker, "").status == common_pb2.HealthResponse.SERVING
        fresh = list(range(300, 340))  # no prefix-cache hit: all 40 tokens are scheduled
        stream, _ = await loop.open(rid, lambda e: e.add_request(rid, fresh, PARAMS))
        assert await asyncio.to_thread(entered.wait, 10)
        deadline = time.monotonic() + 20
        while not loop.stalled:
            assert time.monotonic() < deadline, "the stuck step was never noticed"
            await asyncio.sleep(0.02)
        assert not loop.ready
        assert health_response(loop, worker, "").status == common_pb2.HealthResponse.DRAINING
        gate.set()
        tokens: list[int] = []
        while not (out := await stream.get()).finished:
            tokens += out.new_token_ids
        tokens += out.new_token_ids
        deadline = time.monotonic() + 20
        while loop.stalled:
            assert time.monotonic() < deadline, "readiness never came back"
            await asyncio.sleep(0.02)
        return tokens

    with caplog.at_level(logging.ERROR, logger="services.common.step_watchdog"):
        tokens = asyncio.run(scenario())
    assert len(tokens) == PARAMS.max_tokens
    assert loop.ready
    report = " ".join(r.getMessage() for r in caplog.records)
    assert "1 requests, 40 tokens" in report and "watched-" + "x" * 32 in report, report
    assert rid not in report  # ids are cut short in the report


def test_a_reader_that_fell_behind_catches_up_in_one_message(make_loop, engine):
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=7, logprobs=2)
    prompt = list(range(200, 230))
    want = engine.generate([prompt], params)[0].token_ids  # before a loop thread owns it
    loop = make_loop()
    servicer = DecodeServicer(loop, "", WorkerState("both", "w", "tiny"), 60.0)

    async def scenario() -> list:
        messages = servicer.Generate(decode_pb2.GenerateRequest(
            request_id="behind", prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(
                max_tokens=12, temperature=0.0, has_temperature=True, ignore_eos=True, seed=7,
                logprobs=2)), _Context())
        first = await messages.__anext__()
        deadline = time.monotonic() + 30
        while leftovers(await loop.call(lambda e: e.stats())):  # finished, nothing read yet
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        return [first] + [m async for m in messages]

    deltas = [m.delta for m in asyncio.run(scenario())]
    # Twelve outputs, but the first message went out before the rest were made (or, on a slow
    # machine, with them): everything after it comes as one message, not one per step.
    assert len(deltas) <= 2, [list(d.token_ids) for d in deltas]
    assert [t for d in deltas for t in d.token_ids] == want
    assert [d.output_index for d in deltas] == [0, len(deltas[0].token_ids)][: len(deltas)]
    last = deltas[-1]
    assert len(last.logprobs) == len(last.token_ids)
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 12


def test_gauges_show_what_the_commands_added_before_the_step_that_computes_it(make_loop):
    """A prefill worker's requests come and go within one step: with its stats taken only
    after each step, its waiting and queued-prefill gauges read 0 through every step that
    computed them (an observability audit: 0 on every scrape for 7 s of 8 busy requests; KEDA
    scales prefill on those tokens). The stats the step runs under, read from the step's own
    callback before the loop's after-step refresh, show the request the step computes."""
    loop = make_loop()
    during: list[dict] = []
    loop.on_step = lambda seconds, *size: during.append(dict(loop.stats))

    async def scenario() -> None:
        stream, _ = await loop.open("one", lambda e: e.add_request(
            "one", PROMPT, dataclasses.replace(PARAMS, max_tokens=1)))
        while not (await stream.get()).finished:
            pass

    asyncio.run(scenario())
    # The step's callback runs after its outputs are handed over: it may come a moment after
    # the stream's end (a clean-clone CI run read `during` before it).
    deadline = time.monotonic() + 10
    while not during and time.monotonic() < deadline:
        time.sleep(0.01)
    assert during, "no step ran"
    assert during[0]["waiting"] + during[0]["running"] == 1, during[0]
    assert during[0]["queued_prefill_tokens"] == len(PROMPT), during[0]
