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
    pace = TokenPace(window_s=10, min_span_s=0)
    assert pace.snapshot(0.0) == {"token_interval_s": 0.0, "interval_rows": 0.0}
    pace.step_done(1.00, rows=0, still_running=True)  # a step that admitted the first prompt
    pace.step_done(1.05, rows=3, still_running=True)
    pace.step_done(1.15, rows=3, still_running=False)  # its last streams finished
    assert pace.snapshot(1.2) == pytest.approx({"token_interval_s": 0.075, "interval_rows": 3.0})
    pace.step_done(5.00, rows=3, still_running=True)  # after idling: that gap is nobody's
    assert pace.snapshot(5.0) == pytest.approx({"token_interval_s": 0.075, "interval_rows": 3.0})
    pace.step_done(5.02, rows=3, still_running=True)
    assert pace.snapshot(5.02)["token_interval_s"] == pytest.approx((0.05 + 0.1 + 0.02) / 3)


def test_the_pace_is_per_token_not_per_step():
    """Streams see a step's gap once per row in it: a lone slow step of one row is one
    token's worth of the pace, a step of 100 rows is 100 tokens' worth."""
    pace = TokenPace(window_s=10, min_span_s=0)
    pace.step_done(0.0, rows=0, still_running=True)
    pace.step_done(0.3, rows=1, still_running=True)
    pace.step_done(0.4, rows=100, still_running=True)
    assert pace.snapshot(0.4) == pytest.approx({"token_interval_s": (0.3 + 100 * 0.1) / 101,
                                                "interval_rows": (1 + 100 ** 2) / 101})


def test_one_first_step_is_not_a_pace():
    """`make run`, 13 requests of n=8 under a regex: the decode worker's first step of 24 rows
    took 0.281 s (its grammars, its KV landing); a poll that saw it alone held the worker to 8
    requests. A third of the window must be covered first."""
    pace = TokenPace()  # 3 s: judged once its gaps cover 1 s
    pace.step_done(0.0, rows=0, still_running=True)
    pace.step_done(0.281, rows=24, still_running=True)
    assert pace.snapshot(0.3) == {"token_interval_s": 0.0, "interval_rows": 0.0}
    t = 0.281
    for _ in range(8):
        t += 0.1
        pace.step_done(t, rows=104, still_running=True)
    snapshot = pace.snapshot(t)
    assert snapshot["interval_rows"] > 100 and snapshot["token_interval_s"] < 0.11


def test_old_gaps_age_out_of_the_window():
    pace = TokenPace(window_s=1.0, min_span_s=0)
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
