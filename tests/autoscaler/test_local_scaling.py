"""End to end on this machine: the control loop with the local actuator, real worker processes
(tiny model) registered in a real Redis, and a registry-routed load. A load step makes the
planner start a second decode worker, which registers and takes traffic; when the load falls
it drains that pool back to one worker, which exits cleanly, and no request fails."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.autoscaler.capacity import SLO, CapacityModel, WorkloadShape
from services.autoscaler.control_loop import Autoscaler
from services.autoscaler.local_actuator import LocalActuator
from services.autoscaler.planner import Planner, PlannerConfig
from services.autoscaler.profile import DecodePoint, HardwareProfile, PrefillPoint
from services.autoscaler.sources import RegistrySource
from tests.autoscaler.registry_load import LoadStats, client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

# A made-up profile (the tiny model is too fast for a real one to need a second worker): a
# decode step costs 10 ms per sequence, so at a 50 ms ITL target one decode worker sustains
# 5 sequences, 100 output tokens/s. The load step below asks for several times that.
PROFILE = HardwareProfile(
    model="tiny", device="cpu", dtype="float32", num_threads=1, block_size=16, kv_blocks=256,
    kv_bytes_per_block=4096, max_num_batched_tokens=2048, max_num_seqs=64,
    long_prefill_token_threshold=512, model_load_s=1.0, worker_start_s=3.0,
    prefill=(PrefillPoint(16, 0.001), PrefillPoint(2048, 0.05)),
    decode=(DecodePoint(1, 64, 0.01), DecodePoint(8, 64, 0.08)),
)
CONFIG = PlannerConfig(
    slo=SLO(ttft_s=1.0, itl_s=0.05), shape=WorkloadShape.single(24, 32),
    capacity=CapacityModel(batch_tail_z=0.0),
    min_prefill=1, max_prefill=1, min_decode=1, max_decode=2,
    interval_s=0.5, scale_down_window_s=4.0, scale_down_cooldown_s=2.0,
)
WORKER_ARGS = ["--num-kv-blocks", "256", "--heartbeat-ttl-s", "2", "--drain-grace-s", "30",
               "--metrics-port", "-1", "--log-format", "text"]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(0.1)


def ready(actuator: LocalActuator, role: str) -> list:
    return [w for w in actuator.workers if w.role == role and w.state == "ready"]


def test_load_step_adds_a_decode_worker_and_the_drop_drains_it(tiny_llama_dir, redis_server):
    actuator = LocalActuator(str(tiny_llama_dir), redis_server,
                             {"prefill": WORKER_ARGS, "decode": WORKER_ARGS})
    autoscaler = Autoscaler(RegistrySource(redis_server), Planner(PROFILE, CONFIG), actuator)
    autoscaler.keep_history = 2000
    stop_loop = threading.Event()
    loop = threading.Thread(target=autoscaler.run, args=(stop_loop, CONFIG.interval_s), daemon=True)
    loop.start()
    stats = LoadStats()
    try:
        # The minimum pool: one of each, started by the first iteration.
        wait_until(lambda: len(ready(actuator, "prefill")) == 1 and len(ready(actuator, "decode")) == 1,
                   90, "one prefill and one decode worker")
        first = ready(actuator, "decode")[0]

        async def drive() -> None:
            heavy, light = asyncio.Event(), asyncio.Event()
            clients = [asyncio.create_task(client(redis_server, heavy, stats, 32, seed=i))
                       for i in range(8)]

            def second_serves() -> bool:
                others = [w for w in ready(actuator, "decode") if w is not first]
                return bool(others) and stats.completed[others[0].worker_id] >= 3

            while not second_serves():  # load step: 8 closed-loop clients
                assert time.monotonic() < deadline, "no second decode worker took traffic"
                await asyncio.sleep(0.2)
            heavy.set()
            await asyncio.gather(*clients)
            # Load falls to one slow client, which keeps running through the drain.
            trickle = asyncio.create_task(client(redis_server, light, stats, 32, pause_s=0.5, seed=99))
            while not any(w.state == "exited" for w in actuator.workers if w.role == "decode"):
                assert time.monotonic() < deadline, "the decode pool was not drained back to one"
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)
            light.set()
            await trickle

        deadline = time.monotonic() + 150
        asyncio.run(drive())

        decoders = [w for w in actuator.workers if w.role == "decode"]
        exited = [w for w in decoders if w.state == "exited"]
        assert len(exited) == 1 and exited[0].process.process.returncode == 0, \
            exited[0].process.output if exited else decoders
        assert len(ready(actuator, "decode")) == 1
        assert not stats.failures, stats.failures
        assert all(stats.completed[w.worker_id] > 0 for w in decoders), stats.completed
        ups = [d for _, d in autoscaler.history if d.decode.desired > d.decode.current >= 1]
        downs = [d for _, d in autoscaler.history if d.decode.desired < d.decode.current]
        assert ups and ups[0].decode.desired == 2 and ups[0].decode.reason == "demand forecast"
        assert downs and downs[0].decode.desired == 1
    finally:
        stop_loop.set()
        loop.join(10)
        actuator.close(timeout_s=30)
