"""The local actuator's warm pool, with real worker processes (tiny model) and a real Redis:
it keeps one decode worker standing by (loaded, not registered); a scale-up activates that
worker instead of starting one, the worker is in the registry within the bound below, and a
replacement standby is started behind it. Closing drains standby and serving workers alike."""

from __future__ import annotations

import time

import pytest
import redis

from services.autoscaler.local_actuator import LocalActuator
from services.common.registry import WORKER_KEY
from services.common.standby import list_standby

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

WORKER_ARGS = ["--num-kv-blocks", "64", "--heartbeat-ttl-s", "2", "--metrics-port", "-1",
               "--log-format", "text"]
# Loose for a loaded CI machine; `bench/cold_start.py --warm` measures the join itself.
JOIN_BOUND_S = 3.0


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(0.05)
    return value


def test_scale_up_activates_the_standby_and_refills_the_pool(tiny_llama_dir, redis_server):
    actuator = LocalActuator(str(tiny_llama_dir), redis_server, {"decode": WORKER_ARGS},
                             warm_pool={"decode": 1})
    r = redis.Redis.from_url(redis_server)
    try:
        assert actuator.replicas("decode") == 0  # the first look starts the pool
        pooled = wait_until(lambda: [w for w in actuator.standby("decode") if w.state == "standby"],
                            90, "a standby decode worker")[0]
        assert [w.worker_id for w in list_standby(redis_server)] == [pooled.worker_id]
        assert r.get(WORKER_KEY + pooled.worker_id) is None
        assert actuator.replicas("decode") == 0  # standing by is not serving

        decided = time.monotonic()
        actuator.scale("decode", 1)
        wait_until(lambda: r.get(WORKER_KEY + pooled.worker_id), JOIN_BOUND_S,
                   "the activated worker's registry entry")
        joined_s = time.monotonic() - decided
        assert joined_s < JOIN_BOUND_S
        assert pooled.state == "ready" and actuator.replicas("decode") == 1
        replacement = actuator.standby("decode")
        assert len(replacement) == 1 and replacement[0] is not pooled  # the pool refills
        wait_until(lambda: replacement[0].state == "standby", 90, "the replacement standby")
        assert len([w for w in actuator.workers if w.role == "decode"]) == 2
    finally:
        actuator.close(timeout_s=30)
    assert all(w.state in ("draining", "exited") for w in actuator.workers), actuator.workers
    assert all(w.process.process.returncode == 0 for w in actuator.workers if w.process)
