"""The pace a worker reports for its running streams (services/common/token_pace.py): the gaps
between its steps while requests run, not the idle time between them, over a sliding window;
and through a real engine loop (tiny random model on its own thread) into the Health answer the
gateway polls."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.common.engine_loop import EngineLoop
from services.common.health import WorkerState, health_response
from services.common.token_pace import TokenPace

pytestmark = pytest.mark.timeout(120)


def test_gaps_count_only_while_requests_run():
    pace = TokenPace(window_s=10)
    assert pace.snapshot(0.0) == {"token_interval_s": 0.0, "interval_rows": 0.0}
    pace.step_done(1.00, rows=0, still_running=True)  # a step that admitted the first prompt
    pace.step_done(1.05, rows=2, still_running=True)
    pace.step_done(1.15, rows=4, still_running=False)  # its last streams finished
    assert pace.snapshot(1.2) == pytest.approx({"token_interval_s": 0.075, "interval_rows": 3.0})
    pace.step_done(5.00, rows=1, still_running=True)  # after idling: that gap is nobody's
    assert pace.snapshot(5.0) == pytest.approx({"token_interval_s": 0.075, "interval_rows": 3.0})
    pace.step_done(5.02, rows=1, still_running=True)
    assert pace.snapshot(5.02)["token_interval_s"] == pytest.approx((0.05 + 0.1 + 0.02) / 3)


def test_old_gaps_age_out_of_the_window():
    pace = TokenPace(window_s=1.0)
    pace.step_done(0.0, rows=8, still_running=True)
    pace.step_done(0.4, rows=8, still_running=True)  # a 0.4 s gap
    for i in range(1, 11):
        pace.step_done(0.4 + 0.02 * i, rows=8, still_running=True)
    assert pace.snapshot(0.6)["token_interval_s"] == pytest.approx((0.4 + 0.2) / 11)
    assert pace.snapshot(1.5)["token_interval_s"] == pytest.approx(0.02)  # the 0.4 s gap left
    assert pace.snapshot(3.0) == {"token_interval_s": 0.0, "interval_rows": 0.0}


def test_a_worker_reports_its_streams_pace_in_health(tiny_llama_dir, monkeypatch):
    """Steps slowed to at least 40 ms each: the Health answer shows that pace while three
    streams run, then nothing once they are done and the window has passed."""
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                    num_kv_blocks=64, num_threads=1))
    real_execute = engine.runner.execute_model

    def slow_execute(*args, **kwargs):
        time.sleep(0.04)
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute_model", slow_execute)
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.pace = TokenPace(window_s=0.5)
    loop.start()
    worker = WorkerState("both", "w", "tiny")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    async def scenario() -> tuple[float, float]:
        streams = []
        for i in range(3):
            rid = f"paced-{i}"
            prompt = list(range(10 + 20 * i, 30 + 20 * i))
            stream, _ = await loop.open(rid, lambda e, r=rid, p=prompt: e.add_request(r, p, params))
            streams.append(stream)
        await asyncio.sleep(0.6)  # a window's worth of decode steps
        stats = health_response(loop, worker, "").stats
        seen = (stats.token_interval_s, stats.interval_rows)
        for stream in streams:
            while not (await stream.get()).finished:
                pass
        return seen

    try:
        interval, rows = asyncio.run(scenario())
        assert 0.04 <= interval < 0.5 and rows == pytest.approx(3.0)
        time.sleep(0.6)
        stats = health_response(loop, worker, "").stats
        assert (stats.token_interval_s, stats.interval_rows) == (0.0, 0.0)
    finally:
        loop.stop()
