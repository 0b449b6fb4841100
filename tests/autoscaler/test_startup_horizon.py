"""The autoscaler plans one worker start-up ahead, and without --startup-s that start-up is what
the workers measured of their own (a real worker registered in a real Redis; its heartbeat and
its /metrics), not the profile's constant."""

from __future__ import annotations

import time

import pytest

from services.autoscaler.actuators import DryRunActuator
from services.autoscaler.control_loop import Autoscaler, AutoscalerMetrics, reported_startups
from services.autoscaler.planner import Planner, PlannerConfig
from services.autoscaler.sources import PrometheusSource, RegistrySource
from services.common.registry import WorkerInfo
from splitserve_cli.processes import start_worker

pytestmark = pytest.mark.timeout(120)


def _registered(source: RegistrySource, timeout_s: float = 20.0) -> list[WorkerInfo]:
    deadline = time.monotonic() + timeout_s
    while not (workers := source.workers()):
        assert time.monotonic() < deadline, "the worker never registered"
        time.sleep(0.1)
    return workers


def test_the_horizon_is_the_workers_measured_startup_unless_given(tiny_llama_dir, redis_server,
                                                                   profile):
    worker = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "32",
                          "--redis-url", redis_server, "--heartbeat-ttl-s", "2")
    registry = RegistrySource(redis_server)
    try:
        line = next(line for line in worker.lines if line.startswith("SPLITSERVE_READY"))
        measured = float(line.split("startup_s=")[1].split()[0])
        _registered(registry)
        for source in (registry, PrometheusSource(registry)):
            planner = Planner(profile, PlannerConfig())
            assert planner.startup_s == profile.startup_s  # nothing measured yet
            metrics = AutoscalerMetrics()
            Autoscaler(source, planner, DryRunActuator({"prefill": 1, "decode": 1}),
                       metrics).tick(time.time())
            assert planner.startup_s != profile.startup_s
            # The heartbeat carries the total; /metrics the phases, each to the millisecond.
            assert planner.startup_s == pytest.approx(measured, abs=0.01), type(source)
            assert metrics.startup._value.get() == planner.startup_s

        given = Planner(profile, PlannerConfig(startup_s=42.0))
        Autoscaler(registry, given, DryRunActuator({"prefill": 1, "decode": 1})).tick(time.time())
        assert given.startup_s == 42.0
    finally:
        registry.close()
        worker.kill()


def _info(stats: dict) -> WorkerInfo:
    return WorkerInfo("d1", "decode", "127.0.0.1:1", "", "m", 16, 2048, stats=stats)


def test_a_bad_startup_in_a_registry_entry_is_skipped():
    bad = [{}, {"startup_s": "3"}, {"startup_s": float("nan")}, {"startup_s": -1.0},
           {"startup_s": 0}, {"startup_s": True}, {"startup_s": 1e9}, {"startup_s": None}]
    assert reported_startups([_info(s) for s in bad]) == []
    assert reported_startups([_info({"startup_s": 2.5}), _info({"startup_s": 4})]) == [2.5, 4.0]


def test_the_slowest_worker_sets_the_horizon_and_silence_keeps_it(profile):
    planner = Planner(profile, PlannerConfig())
    planner.observe_startup([3.0, 9.5, 4.0])
    assert planner.startup_s == 9.5
    planner.observe_startup([])
    assert planner.startup_s == 9.5
