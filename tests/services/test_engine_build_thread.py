"""The engine is built on a thread that exits, so the engine loop's thread is the only one in
the worker with an OpenMP team (GNU OpenMP stops spinning at barriers once a process has more
OpenMP threads than CPUs, and every step then sleeps and wakes at each parallel region; see
services/common/engine_build.build_engine). A fresh interpreter per variant, real engine (tiny
random model, 2 torch threads) on a real EngineLoop; the threads counted are the process's OS
threads that are not Python's, which is where OpenMP's workers live. The control builds the
engine on the main thread, as the worker did before, and leaves one team more."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = textwrap.dedent("""
    import asyncio, os, sys, threading
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from services.common.engine_build import build_engine
    from services.common.engine_loop import EngineLoop

    def native_threads():
        python = {t.native_id for t in threading.enumerate()}
        return {int(t) for t in os.listdir("/proc/self/task")} - python

    before = native_threads()
    make = lambda: LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", num_kv_blocks=64,
                                          num_threads=2, small_step_threads=2))
    engine = build_engine(make) if sys.argv[2] == "thread" else make()
    loop = EngineLoop(engine, idle_wait_s=0.01)
    loop.start()

    async def run():
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        stream, _ = await loop.open("r", lambda e: e.add_request("r", list(range(5, 300)), params))
        while not (await stream.get()).finished:
            pass

    asyncio.run(run())
    print("NATIVE_THREADS", len(native_threads() - before))
    loop.stop()
""")


def _native_threads(model, where: str) -> int:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(model), where], capture_output=True,
                         text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("NATIVE_THREADS")][-1]
    return int(line.split()[1])


def test_building_on_a_passing_thread_leaves_one_openmp_team(tiny_llama_dir):
    on_main = _native_threads(tiny_llama_dir, "main")
    on_thread = _native_threads(tiny_llama_dir, "thread")
    # Two torch threads: a team is its caller plus one worker thread. Built on the main
    # thread, the main thread keeps its team after the build; built on a passing thread, not.
    assert on_thread == on_main - 1, (on_main, on_thread)


def test_build_errors_reach_the_caller():
    from services.common.engine_build import build_engine

    def fail():
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        build_engine(fail)
