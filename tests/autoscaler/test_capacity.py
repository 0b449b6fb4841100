"""Per-replica capacity within the SLOs, and `capacity plan` arithmetic."""

from __future__ import annotations

import math

import pytest

from services.autoscaler.capacity import (
    SLO,
    CapacityModel,
    WorkloadShape,
    plan_for_rate,
    replicas_for,
)
from tests.autoscaler.sample_profiles import make_profile


def test_length_mix_parses_and_averages_by_weight():
    shape = WorkloadShape.parse("256:64:3, 1024:256:1")
    assert shape.mean_prompt_tokens == pytest.approx(448)
    assert shape.mean_output_tokens == pytest.approx(112)
    for bad in ("256", "0:10", "1:2:-1", "a:b"):
        with pytest.raises(ValueError):
            WorkloadShape.parse(bad)


def test_prefill_replica_may_be_busier_when_the_ttft_target_is_looser(profile):
    shape = WorkloadShape.single(256, 64)
    tight = CapacityModel().prefill(profile, SLO(ttft_s=0.5), shape)
    loose = CapacityModel().prefill(profile, SLO(ttft_s=5.0), shape)
    assert tight.feasible and loose.feasible
    assert tight.service_s == pytest.approx(0.256)
    assert tight.tokens_per_s < loose.tokens_per_s <= 0.85 * loose.peak_tokens_per_s + 1e-6
    assert loose.utilization == pytest.approx(0.85)  # capped by max_utilization


def test_prefill_is_infeasible_when_an_idle_replica_misses_ttft(profile):
    cap = CapacityModel().prefill(profile, SLO(ttft_s=0.2), WorkloadShape.single(1024, 64))
    assert not cap.feasible and cap.tokens_per_s == 0


def test_long_prompts_are_timed_in_chunks(profile):
    cap = CapacityModel().prefill(profile, SLO(ttft_s=10), WorkloadShape.single(1300, 10))
    assert cap.service_s == pytest.approx(2 * 0.512 + 0.276)


def test_decode_batch_is_limited_by_itl_with_a_tail_margin(profile):
    shape = WorkloadShape.single(127, 2)  # mean context 127 + 2 / 2 = 128
    exact = CapacityModel(batch_tail_z=0).decode(profile, SLO(itl_s=0.102), shape)
    # 0.025 + 0.005 * (b - 1) <= 0.102  ->  b <= 16
    assert exact.limited_by == "itl" and exact.batch_size == 16
    margin = CapacityModel().decode(profile, SLO(itl_s=0.102), shape)
    assert margin.batch_size + 2 * math.sqrt(margin.batch_size) <= 16 < margin.batch_size + 1 + 2 * math.sqrt(margin.batch_size + 1)
    assert margin.tokens_per_s == pytest.approx(margin.batch_size / margin.step_s)


def test_decode_batch_is_limited_by_kv_when_contexts_are_long():
    profile = make_profile(kv_blocks=100)
    cap = CapacityModel().decode(profile, SLO(itl_s=1.0), WorkloadShape.single(1000, 100))
    assert cap.limited_by == "kv"
    assert cap.batch_size == int(100 * 0.9 // (math.ceil(1050 / 16) + 1))


def test_plan_grows_with_rate_and_adds_spares(profile):
    shape, slo = WorkloadShape.single(256, 128), SLO(ttft_s=1.0, itl_s=0.1)
    small = plan_for_rate(profile, 1.0, shape, slo, spare=0)
    big = plan_for_rate(profile, 20.0, shape, slo, spare=0)
    spared = plan_for_rate(profile, 20.0, shape, slo, spare=1)
    assert small.prefill_replicas >= 1 and small.decode_replicas >= 1
    assert big.prefill_replicas > small.prefill_replicas and big.decode_replicas > small.decode_replicas
    assert (spared.prefill_replicas, spared.decode_replicas) == (big.prefill_replicas + 1, big.decode_replicas + 1)
    assert big.prefill_replicas == replicas_for(20 * 256, big.prefill.tokens_per_s)
    assert "spare" in spared.describe()


def test_replicas_for_rounds_up_and_treats_zero_demand_as_none():
    assert replicas_for(0, 10) == 0
    assert replicas_for(10, 10) == 1
    assert replicas_for(10.5, 10) == 2


def test_decode_context_weighs_long_outputs_by_the_time_they_spend_in_the_batch():
    shape = WorkloadShape.parse("100:10:1,1000:100:1")
    # 10 steps at ~105 tokens and 100 steps at ~1050 tokens: ~964, not the plain mean ~578.
    assert shape.mean_decode_context == pytest.approx((10 * 105 + 100 * 1050) / 110)
