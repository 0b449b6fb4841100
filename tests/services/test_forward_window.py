"""A KV reservation made while the engine thread runs the model
(services/common/forward_window.py): a real engine (tiny random model) on the loop's real
thread, its model run held open on an event, so the window is hit deterministically. The
reservation is made inside the window; a plain open, or one behind a queued command (which
must run first: the command queue is one FIFO), waits for the step to end; the step then
goes on and the reservation's KV lands as any other's."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(5, 45))  # 40 tokens: 3 blocks of 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, seed=7)


def test_a_reservation_is_made_while_the_engine_thread_runs_the_model(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                    num_kv_blocks=64, num_threads=1))
    loop = EngineLoop(engine, idle_wait_s=0.01)
    gate, inside, hold = threading.Event(), threading.Event(), threading.Event()
    real = engine.runner.execute_model

    def held_run(*args, **kwargs):
        if hold.is_set():
            hold.clear()
            inside.set()
            assert gate.wait(30)
        return real(*args, **kwargs)

    engine.runner.execute_model = held_run
    loop.start()

    def reserve(rid: str):
        return lambda e: e.remote.reserve(rid, PROMPT, PARAMS)

    async def scenario() -> None:
        running, _ = await loop.open("running", lambda e: e.add_request(
            "running", list(range(7, 30)), SamplingParams(max_tokens=64, temperature=0.0,
                                                          ignore_eos=True)))
        await running.get()
        hold.set()
        assert await asyncio.to_thread(inside.wait, 10), "no step reached the model run"
        start = time.monotonic()
        now, reservation = await asyncio.wait_for(
            loop.open("now", reserve("now"), during_forward=True), 5.0)
        assert time.monotonic() - start < 5.0 and len(reservation.block_ids) == 3
        assert "now" in engine.scheduler.waiting_for_kv
        assert loop.stats["waiting_for_kv"] == 1  # what the KV room reads, refreshed
        queued = asyncio.ensure_future(loop.open("queued", reserve("queued")))
        behind = asyncio.ensure_future(loop.open("behind", reserve("behind"),
                                                 during_forward=True))
        await asyncio.sleep(0.3)
        assert not queued.done() and not behind.done(), "made before the step ended"
        gate.set()
        await asyncio.wait_for(asyncio.gather(queued, behind), 10.0)
        # The reservation made in the window takes its KV like any other, and decodes.
        payload = await loop.call(lambda e: e.runner.gather_kv(reservation.block_ids).clone())
        loop.receive_remote_kv("now", 11, payload)
        tokens = [11]
        while True:
            out = await asyncio.wait_for(now.get(), 10.0)
            tokens += out.new_token_ids
            if out.finished:
                break
        assert len(tokens) == PARAMS.max_tokens
        for rid in ("running", "queued", "behind"):
            loop.abort(rid)
        deadline = time.monotonic() + 10
        while engine.has_unfinished():
            assert time.monotonic() < deadline, "work left in the engine"
            await asyncio.sleep(0.01)

    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
