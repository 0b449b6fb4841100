"""The step watchdog on a real worker: a tensor-parallel rank that stops answering (SIGSTOP)
leaves rank 0's step waiting in a gloo collective; past --step-timeout-s the worker reports not
ready on /ready and in gRPC Health, so a gateway routes around it, and logs what the step held;
held ten times the bound, it fails liveness (/health) too. When the rank resumes, the step
ends, the request finishes correctly and readiness and liveness return."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from splitserve.v1 import common_pb2

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from splitserve_cli.processes import start_worker
from tests.services.flows import aggregated, greedy

pytestmark = pytest.mark.timeout(240)


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {timeout_s}s")
        time.sleep(0.05)


def test_a_stuck_step_makes_the_worker_unready_until_it_ends(tiny_llama_dir):
    worker = start_worker("both", tiny_llama_dir, "--tensor-parallel-size", "2",
                          "--dtype", "float32", "--num-kv-blocks", "64",
                          "--step-timeout-s", "1")
    rank1 = worker.rank_pids[0]
    stopped = False
    try:
        ready_url = f"http://{worker.metrics_address}/ready"
        assert httpx.get(ready_url).status_code == 200
        assert worker.health().status == common_pb2.HealthResponse.SERVING
        prompt = list(range(20, 60))
        reference = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                           num_kv_blocks=64, num_threads=1))
        want = reference.generate([prompt], SamplingParams(
            max_tokens=6, temperature=0.0, ignore_eos=True, seed=7))[0].token_ids

        async def run() -> list[int]:
            nonlocal stopped
            os.kill(rank1, signal.SIGSTOP)
            stopped = True
            request = asyncio.ensure_future(
                aggregated(worker.address, "watched-request", prompt, greedy(6)))
            loop = asyncio.get_running_loop()
            # The step waits for rank 1 for as long as it is stopped: no race with the bound.
            await loop.run_in_executor(None, lambda: wait_until(
                lambda: httpx.get(ready_url).status_code == 503, 30, "not ready"))
            health = worker.health()
            assert health.status == common_pb2.HealthResponse.DRAINING
            live_url = f"http://{worker.metrics_address}/health"
            assert httpx.get(live_url).status_code == 200
            # Held WEDGED_STEPS (10) times the bound, the step is wedged: liveness fails
            # too, so an orchestrator would restart the worker rather than wait forever.
            await loop.run_in_executor(None, lambda: wait_until(
                lambda: httpx.get(live_url).status_code == 503, 30, "not live"))
            assert not request.done()
            os.kill(rank1, signal.SIGCONT)
            stopped = False
            return await asyncio.wait_for(request, 60)

        assert asyncio.run(run()) == want
        wait_until(lambda: httpx.get(ready_url).status_code == 200, 30, "ready again")
        assert httpx.get(f"http://{worker.metrics_address}/health").status_code == 200
        assert worker.health().status == common_pb2.HealthResponse.SERVING
        assert "over --step-timeout-s" in worker.output
        assert "request ids: watched-request" in worker.output
    finally:
        if stopped:
            os.kill(rank1, signal.SIGCONT)
        worker.kill()
