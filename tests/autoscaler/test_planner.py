"""The planner's decisions: size for the forecast one start-up ahead, scale down only after a
stable window with a hysteresis margin, drain gradually, stay within min/max."""

from __future__ import annotations

import math

import pytest

from services.autoscaler.capacity import SLO, CapacityModel, WorkloadShape
from services.autoscaler.demand import DemandSample
from services.autoscaler.planner import Planner, PlannerConfig
from tests.autoscaler.sample_profiles import make_profile

SHAPE = WorkloadShape.single(256, 128)
SLO_ = SLO(ttft_s=1.0, itl_s=0.1)


def planner(**overrides) -> Planner:
    return Planner(make_profile(), PlannerConfig(slo=SLO_, shape=SHAPE, max_prefill=20,
                                                 max_decode=20, **overrides))


def per_prefill() -> float:
    return CapacityModel().prefill(make_profile(), SLO_, SHAPE).tokens_per_s


def per_decode() -> float:
    return CapacityModel().decode(make_profile(), SLO_, SHAPE).tokens_per_s


def feed(p: Planner, start: float, end: float, prompt: float = 0.0, output: float = 0.0,
         queued: float = 0.0, prefill_ready: int = 1, step: float = 2.0) -> float:
    t = start
    while t <= end:
        p.observe(DemandSample(t, prompt, output, queued_prefill_tokens=queued,
                               prefill_ready=prefill_ready, decode_ready=1))
        t += step
    return t - step


def test_scale_up_goes_straight_to_what_the_demand_needs():
    p = planner()
    now = feed(p, 0, 120, prompt=4000, output=200)
    decision = p.plan(now, {"prefill": 1, "decode": 1})
    assert decision.prefill.reason == "demand forecast"
    assert decision.prefill.desired == math.ceil(4000 / per_prefill())
    assert decision.decode.desired == math.ceil(max(200, 4000 * 128 / 256) / per_decode())


def test_scale_up_stops_at_the_maximum():
    p = planner()
    now = feed(p, 0, 60, prompt=10**6)
    assert p.plan(now, {"prefill": 3, "decode": 1}).prefill.desired == 20


def test_a_ramp_is_met_before_it_arrives():
    p = planner()
    t = 0.0
    while t <= 120:
        p.observe(DemandSample(t, 20.0 * t, 0.0))  # +20 prompt tokens/s every second
        t += 2
    latest = 20.0 * (t - 2)
    decision = p.plan(t - 2, {"prefill": 1, "decode": 1})
    assert decision.prefill.demand > latest  # the forecast looks start-up + interval ahead
    assert decision.prefill.desired >= math.ceil(latest / per_prefill())


def test_scale_down_waits_for_the_window_then_drains_at_most_half_per_step():
    p = planner()
    now = feed(p, 0, 120, prompt=8000)
    current = p.plan(now, {"prefill": 1, "decode": 1}).prefill.desired
    assert current > 4
    now = feed(p, now + 2, now + 30, prompt=8000)  # the pool settles at that size
    assert p.plan(now, {"prefill": current, "decode": 1}).prefill.desired == current
    drop = now + 2
    history = []
    t = drop
    while t < drop + 400:
        p.observe(DemandSample(t, 0.0, 0.0))
        decision = p.plan(t, {"prefill": current, "decode": 1}).prefill
        if decision.desired < current:
            assert decision.reason == "demand fell (draining)"
            assert current - decision.desired <= max(1, current // 2)
            history.append((t, current, decision.desired))
            current = decision.desired
        t += 2
    assert current == 1  # the minimum
    # The window mean still sees the old load for a while: no instant collapse to the minimum.
    assert len(history) >= 3 and history[0][2] > 1
    gaps = [b[0] - a[0] for a, b in zip(history, history[1:], strict=False)]
    assert all(g >= 15 for g in gaps)  # scale_down_cooldown_s


def test_hysteresis_keeps_a_pool_that_is_only_slightly_too_big():
    per = per_prefill()
    held = planner()
    now = feed(held, 0, 200, prompt=3 * per * 0.95)
    assert held.plan(now, {"prefill": 4, "decode": 1}).prefill.desired == 4
    eager = planner(hysteresis=0.0)
    now = feed(eager, 0, 200, prompt=3 * per * 0.95)
    assert eager.plan(now, {"prefill": 4, "decode": 1}).prefill.desired == 3


def test_the_minimum_is_restored_at_once():
    p = planner(min_prefill=2, min_decode=3)
    decision = p.plan(0.0, {"prefill": 0, "decode": 1})
    assert (decision.prefill.desired, decision.decode.desired) == (2, 3)
    assert decision.prefill.reason == "limits"


def test_a_backlog_beyond_what_the_pool_clears_within_ttft_adds_replicas():
    calm, backed_up = planner(), planner()
    now = feed(calm, 0, 60, prompt=per_prefill(), queued=10)
    feed(backed_up, 0, 60, prompt=per_prefill(), queued=50_000)
    assert calm.plan(now, {"prefill": 1, "decode": 1}).prefill.desired == 1
    needed = backed_up.plan(now, {"prefill": 1, "decode": 1}).prefill.desired
    assert needed > 1 + 50_000 / 10.0 / per_prefill() * 0.5


def test_decode_scales_on_prompt_arrivals_before_any_output_is_seen():
    p = planner()
    now = feed(p, 0, 30, prompt=6000, output=0)
    assert p.plan(now, {"prefill": 1, "decode": 1}).decode.desired > 1


def test_config_rejects_inverted_limits():
    with pytest.raises(ValueError, match="min"):
        PlannerConfig(min_decode=5, max_decode=2)


def test_below_the_minimum_under_load_goes_straight_to_the_demand():
    p = planner(min_prefill=2)
    now = feed(p, 0, 60, prompt=8000)
    decision = p.plan(now, {"prefill": 0, "decode": 1}).prefill
    assert decision.desired == math.ceil(8000 / per_prefill()) > 2


def test_no_samples_yet_changes_nothing_above_the_minimum():
    decision = planner().plan(0.0, {"prefill": 3, "decode": 2})
    assert (decision.prefill.desired, decision.decode.desired) == (3, 2)


def test_with_minutes_of_start_up_capacity_goes_no_faster_than_it_comes_back():
    """GPU workers take minutes to start: the window spans two start-ups and scale-downs are a
    start-up apart. (With the 60 s window and 15 s cooldown alone, an audit's 16 idle replicas
    went to 1 in 48 s after one quiet minute.)"""
    startup = 180.0
    p = planner(startup_s=startup)
    current, t = 16, 0.0
    history = []
    while t <= 3600:
        p.observe(DemandSample(t, 0.0, 0.0))
        decision = p.plan(t, {"prefill": current, "decode": 1}).prefill
        if decision.desired < current:
            history.append(t)
            current = decision.desired
        t += 2
    assert current == 1
    assert history[0] >= 2 * startup - 2  # a full window of two start-ups first
    assert all(b - a >= startup for a, b in zip(history, history[1:], strict=False))


def test_a_short_start_up_keeps_the_configured_window_and_cooldown():
    p = planner(startup_s=4.8)
    assert (p.down_window_s, p.down_cooldown_s) == (60.0, 15.0)
