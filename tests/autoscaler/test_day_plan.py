"""The day-scale capacity study: the diurnal + spike day and its trace, KV-transfer arithmetic,
cost per 1,000 queries, what a lost replica or zone does, and `splitserve capacity day`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.autoscaler.capacity import SLO, WorkloadShape, plan_for_rate
from services.autoscaler.day_plan import (
    DAY_S,
    LINKS,
    DayShape,
    cost_per_1k_queries,
    kv_bytes_per_decode_replica,
    link_load,
    plan_day,
    sustained_rate,
    zone_survivors,
)
from services.autoscaler.day_report import failure_cases, simulate_window
from services.autoscaler.profile import HardwareProfile
from services.autoscaler.traces import day_window
from tests.autoscaler.sample_profiles import make_profile

ROOT = Path(__file__).resolve().parents[2]
LLAMA8B = ROOT / "services/autoscaler/profiles/llama8b-h200.json"
SHAPE = WorkloadShape.single(256, 64)
SLO_ = SLO(ttft_s=2.0, itl_s=0.2)


def test_day_averages_its_queries_peaks_at_3x_and_spikes_at_10x():
    day = DayShape(50e6)
    rates = [day.diurnal_rate(t) for t in range(0, int(DAY_S), 10)]
    assert sum(rates) / len(rates) == pytest.approx(50e6 / DAY_S, rel=1e-4)
    assert max(rates) == pytest.approx(3 * 50e6 / DAY_S, rel=1e-4)
    assert day.diurnal_rate(14 * 3600) == pytest.approx(day.peak_rate)
    assert 0 < min(rates) < day.mean_rate / 2  # a night trough, never negative
    assert day.rate(14 * 3600 + 30) == pytest.approx(10 * day.mean_rate)  # inside the spike
    assert day.rate(14 * 3600 + 61) == pytest.approx(day.diurnal_rate(14 * 3600 + 61))
    hourly = day.hourly_max()
    assert len(hourly) == 24 and max(hourly) == pytest.approx(day.peak_rate)
    assert hourly.index(max(hourly)) in (13, 14)


def test_a_peak_the_curve_cannot_reach_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="trough would be negative"):
        DayShape(50e6, peak_factor=6.0)
    with pytest.raises(ValueError):
        DayShape(0)


def test_day_window_trace_follows_the_rate_at_its_share():
    day = DayShape(50e6)
    start, share = day.spike_start_s - 60, 0.01
    trace = day_window(day, SHAPE, start, 180, share, seed=3, failures=((30.0, "decode"),))
    arrivals = [r.arrival for r in trace.requests]
    before = sum(1 for a in arrivals if a < 60)
    spike = sum(1 for a in arrivals if 60 <= a < 120)
    expected_before = share * sum(day.rate(start + t + 0.5) for t in range(60))
    expected_spike = share * day.spike_rate * 60
    assert before == pytest.approx(expected_before, rel=0.1)
    assert spike == pytest.approx(expected_spike, rel=0.05)
    assert trace.peak_rate == pytest.approx(share * day.spike_rate)
    assert trace.failures == ((30.0, "decode"),)
    brief = DayShape(50e6, spike_s=0.5)  # between the 1 s grid points the window is read on
    assert day_window(brief, SHAPE, brief.spike_start_s - 10.3, 20, share).peak_rate == pytest.approx(
        share * brief.spike_rate)
    with pytest.raises(ValueError):
        day_window(day, SHAPE, 0, 60, share=0)


def test_kv_transfer_bandwidth_is_prompt_tokens_times_kv_bytes_per_prefill_gpu():
    profile = make_profile()  # 16 tokens/block, 64 KiB/block = 4 KiB per token
    plan = plan_for_rate(profile, 10.0, SHAPE, SLO_, spare=1)
    load = link_load(profile, plan)
    n_prefill, n_decode = plan.prefill_replicas - 1, plan.decode_replicas - 1
    assert load.kv_bytes_per_token == 4096
    assert load.prefill_egress_bytes_per_s == pytest.approx(10 * 256 * 4096 / n_prefill)
    assert load.pair_bytes_per_s == pytest.approx(load.prefill_egress_bytes_per_s / n_decode)
    assert load.prompt_kv_bytes == 256 * 4096
    for name, (capacity, _) in LINKS.items():
        assert load.utilization[name] == pytest.approx(load.prefill_egress_bytes_per_s / capacity)
        assert load.prompt_transfer_s[name] == pytest.approx(256 * 4096 / capacity)
    assert load.utilization["tcp"] > load.utilization["rdma"] > load.utilization["nvlink"]


def test_kv_in_use_per_decode_replica_is_littles_law_over_the_working_replicas():
    profile = make_profile()
    plan = plan_for_rate(profile, 10.0, SHAPE, SLO_, spare=0)
    used, pool = kv_bytes_per_decode_replica(profile, plan)
    blocks = plan.decode_sequences / plan.decode_replicas * (profile.blocks_for(SHAPE.mean_decode_context) + 1)
    assert used == pytest.approx(blocks * (1 << 16))
    assert pool == 1000 * (1 << 16)


def test_cost_per_1k_queries_is_gpu_hours_times_price_per_thousand():
    assert cost_per_1k_queries(24, 2.0, 48_000) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        cost_per_1k_queries(1, 1, 0)
    day = DayShape(1e6, spike_factor=0)
    rows = plan_day(make_profile(), day, SHAPE, SLO_, price_per_gpu_hour=4.0, spare=0)
    for row in rows:
        assert row.gpu_hours == sum(row.prefill) + sum(row.decode)
        assert row.cost_per_1k == pytest.approx(row.gpu_hours * 4.0 / 1000)
    by_name = {r.name: r for r in rows}
    assert by_name["hourly"].gpu_hours < by_name["fixed-peak"].gpu_hours


def test_a_spike_shorter_than_start_up_is_met_only_by_the_running_pool():
    profile = make_profile()  # 5 s start-up
    short = {r.name: r for r in plan_day(profile, DayShape(2e6, spike_s=3), SHAPE, SLO_, 1.0)}
    long = {r.name: r for r in plan_day(profile, DayShape(2e6, spike_s=600), SHAPE, SLO_, 1.0)}
    assert short["fixed-spike"].attainment == pytest.approx(1.0)
    assert short["fixed-peak"].attainment < 1.0
    # The hourly pool at the peak is the fixed-peak pool, and nothing it asks for arrives in time.
    assert short["hourly"].attainment == pytest.approx(short["fixed-peak"].attainment)
    # A long spike: the hourly policy's new replicas arrive while it lasts.
    assert long["hourly"].attainment > long["fixed-peak"].attainment


def test_one_lost_replica_is_covered_by_the_spare_and_a_lost_zone_is_not():
    profile = make_profile()
    day = DayShape(5e6)
    spared = {r.name: r for r in plan_day(profile, day, SHAPE, SLO_, 1.0, spare=1, zones=3)}
    bare = {r.name: r for r in plan_day(profile, day, SHAPE, SLO_, 1.0, spare=0, zones=3)}
    assert spared["hourly"].one_replica_lost == pytest.approx(1.0)
    assert bare["hourly"].one_replica_lost < 1.0
    assert spared["hourly"].zone_lost < 1.0
    assert spared["fixed-spike"].zone_lost == pytest.approx(1.0)  # spike headroom covers a zone
    assert zone_survivors(10, 3) == 6 and zone_survivors(9, 3) == 6 and zone_survivors(4, 1) == 0
    p = spared["hourly"].prefill[14]
    d = spared["hourly"].decode[14]
    expected = sustained_rate(profile, SHAPE, SLO_, zone_survivors(p, 3), zone_survivors(d, 3))
    assert spared["hourly"].zone_lost == pytest.approx(min(1.0, expected / day.peak_rate))


def test_simulated_window_runs_each_policy_with_a_lost_replica_and_a_lost_zone():
    profile = make_profile()
    day = DayShape(20e6)
    cases = failure_cases(profile, day, SHAPE, SLO_, share=0.01, zones=2, at_s=10.0)
    assert cases["spike"] == ()
    assert sorted(role for _, role in cases["replica lost"]) == ["decode", "prefill"]
    assert len(cases["zone lost"]) > len(cases["replica lost"])
    rows = simulate_window(profile, day, SHAPE, SLO_, seconds=40, share=0.002, zones=2, price=2.0)
    assert [(r.trace, r.policy) for r in rows] == [
        (case, policy) for case in ("spike", "replica lost", "zone lost")
        for policy in ("fixed", "reactive", "planner")]
    for row in rows:
        assert row.requests > 0 and 0 <= row.slo_attainment <= 1
        assert row.cost_per_1k == pytest.approx(row.fleet_gpu_hours * 0.002 * 2.0 / row.requests * 1000)


def test_llama8b_profile_is_labelled_as_published_figures():
    profile = HardwareProfile.load(LLAMA8B)
    assert profile.host == "published figures, not measured here"
    assert "not measured here" in profile.notes["source"]
    assert profile.kv_bytes_per_block == 16 * 32 * 8 * 128 * 2 * 2  # Llama-3.1-8B, bf16
    assert profile.decode_step_seconds(1, 512) == pytest.approx(0.0055, rel=0.05)


def _capacity_day(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitserve_cli.main", "capacity", "day", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_capacity_day_prints_replicas_cost_kv_and_links_and_refuses_bad_input():
    done = _capacity_day("--profile", str(LLAMA8B), "--price-per-gpu-hour", "2.5")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "published figures, not measured here" in out
    assert "50,000,000 queries" in out and "$2.50/GPU-hour" in out
    assert sum(1 for line in out.splitlines() if line[:2].isdigit() and line[2:4] == "  ") == 24
    for word in ("fixed-spike", "fixed-peak", "hourly", "KV per decode replica", "nvlink", "rdma", "tcp"):
        assert word in out
    bad = _capacity_day("--profile", str(LLAMA8B), "--peak-factor", "8")
    assert bad.returncode != 0 and "trough would be negative" in bad.stderr
    assert "Traceback" not in bad.stderr
