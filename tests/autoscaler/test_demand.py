"""Worker stats (registry heartbeats) -> DemandSample: rates from each worker's own counter
deltas, queue growth counted as arrivals, and no phantom rates from joins or restarts."""

from __future__ import annotations

import pytest

from services.autoscaler.demand import WorkerStatsRates
from services.common.registry import WorkerInfo


def worker(wid: str, role: str, updated: float, draining: bool = False, **stats) -> WorkerInfo:
    base = {"running": 0, "waiting": 0, "waiting_for_kv": 0, "kv_blocks_total": 100,
            "kv_blocks_free": 100, "queued_prefill_tokens": 0, "computed_tokens": 0, "steps": 0}
    return WorkerInfo(worker_id=wid, role=role, address="x", kv_endpoint="", model="m",
                      block_size=16, max_model_len=0, draining=draining,
                      stats={**base, **stats}, updated=updated)


def test_prompt_rate_is_computed_tokens_plus_queue_growth():
    rates = WorkerStatsRates()
    rates.update(0, [worker("p1", "prefill", 0.0, computed_tokens=1000, queued_prefill_tokens=100)])
    sample = rates.update(2, [worker("p1", "prefill", 2.0, computed_tokens=1400,
                                     queued_prefill_tokens=700)])
    assert sample.prompt_tokens_per_s == pytest.approx((400 + 600) / 2)
    assert sample.queued_prefill_tokens == 700 and sample.prefill_ready == 1


def test_output_rate_and_kv_use_come_from_decode_workers():
    rates = WorkerStatsRates()
    rates.update(0, [worker("d1", "decode", 0.0, computed_tokens=50),
                     worker("d2", "decode", 0.0, computed_tokens=0)])
    sample = rates.update(1, [
        worker("d1", "decode", 1.0, computed_tokens=150, running=4, kv_blocks_free=60),
        worker("d2", "decode", 1.0, computed_tokens=50, running=1, waiting_for_kv=1, kv_blocks_free=90),
    ])
    assert sample.output_tokens_per_s == pytest.approx(150)
    assert sample.decode_sequences == 6 and sample.decode_ready == 2
    assert (sample.kv_blocks_used, sample.kv_blocks_total) == (50, 200)
    assert sample.mean_context_tokens == pytest.approx(50 * 16 / 6)


def test_a_new_worker_and_a_restarted_one_add_no_rate():
    rates = WorkerStatsRates()
    rates.update(0, [worker("d1", "decode", 0.0, computed_tokens=5000)])
    sample = rates.update(1, [worker("d1", "decode", 1.0, computed_tokens=10),  # restarted
                              worker("d2", "decode", 1.0, computed_tokens=9999)])  # new
    assert sample.output_tokens_per_s == 0
    sample = rates.update(2, [worker("d1", "decode", 2.0, computed_tokens=110),
                              worker("d2", "decode", 2.0, computed_tokens=10099)])
    assert sample.output_tokens_per_s == pytest.approx(200)


def test_a_stale_heartbeat_keeps_the_last_rate_and_draining_workers_are_left_out():
    rates = WorkerStatsRates()
    rates.update(0, [worker("d1", "decode", 0.0)])
    rates.update(1, [worker("d1", "decode", 1.0, computed_tokens=100)])
    sample = rates.update(1.5, [worker("d1", "decode", 1.0, computed_tokens=100),
                                worker("d9", "decode", 1.5, draining=True, running=7)])
    assert sample.output_tokens_per_s == pytest.approx(100)
    assert sample.decode_ready == 1 and sample.decode_sequences == 0
