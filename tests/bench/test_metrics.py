"""Load generator arithmetic on synthetic timings: percentiles, TPOT, goodput, throughput, and how
failures are counted."""

from __future__ import annotations

import numpy as np
import pytest

from bench.loadgen.metrics import SLO, Distribution, RequestRecord, percentile, summarize


def rec(i=0, status="ok", ttft=0.2, e2e=1.2, out=11, asked=11, itl=(), prompt=100,
        prompt_reported=None) -> RequestRecord:
    return RequestRecord(index=i, cls="c", tenant="", prompt_len=prompt, output_len=asked,
                         start_s=0.0, status=status, ttft_s=ttft if status == "ok" else None,
                         itl_s=tuple(itl), e2e_s=e2e, output_tokens=out if status == "ok" else 0,
                         prompt_tokens_reported=prompt_reported)


def test_percentile_interpolates_linearly_between_ranks():
    values = list(range(1, 101))
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile(values, 90) == pytest.approx(np.percentile(values, 90))
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_percentile_matches_numpy_on_random_data():
    values = list(np.random.default_rng(3).lognormal(0, 1, 997))
    for q in (50, 90, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_tpot_is_time_after_first_token_over_remaining_tokens():
    assert rec(ttft=0.5, e2e=2.5, out=11).tpot_s == pytest.approx(0.2)
    assert rec(out=1).tpot_s is None  # no token after the first
    assert rec(status="http_429").tpot_s is None


def test_goodput_counts_only_completed_requests_meeting_both_targets():
    records = [
        rec(0, ttft=0.5, e2e=0.5 + 10 * 0.05, out=11),  # ttft 0.5, tpot 50ms: good
        rec(1, ttft=1.5, e2e=1.5 + 10 * 0.05, out=11),  # ttft misses
        rec(2, ttft=0.5, e2e=0.5 + 10 * 0.15, out=11),  # tpot misses
        rec(3, status="http_429"),
        rec(4, ttft=0.9, e2e=0.9, out=1),  # a single token has no TPOT to miss
    ]
    s = summarize(records, wall_s=2.0, slo=SLO(ttft_s=1.0, tpot_s=0.1))
    assert s.goodput == pytest.approx(2 / 2.0)
    assert s.goodput_fraction == pytest.approx(2 / 5)
    assert s.completed == 4 and s.requests == 5


def test_goodput_target_boundaries_are_inclusive_and_tightening_them_lowers_goodput():
    records = [rec(0, ttft=1.0, e2e=1.0 + 10 * 0.1, out=11)]
    assert summarize(records, 1.0, SLO(1.0, 0.1)).goodput == pytest.approx(1.0)
    assert summarize(records, 1.0, SLO(0.99, 0.1)).goodput == 0.0
    assert summarize(records, 1.0, SLO(1.0, 0.099)).goodput == 0.0


def test_throughput_counts_completed_requests_and_their_tokens_over_wall_time():
    records = [rec(0, out=100, asked=100), rec(1, out=50, asked=50), rec(2, status="error")]
    s = summarize(records, wall_s=5.0)
    assert s.request_throughput == pytest.approx(2 / 5)
    assert s.output_throughput == pytest.approx(150 / 5)
    assert s.total_token_throughput == pytest.approx((200 + 150) / 5)


def test_rejections_are_counted_apart_from_other_failures():
    records = [rec(0, status="http_429"), rec(1, status="http_429"), rec(2, status="http_503"),
               rec(3, status="http_500"), rec(4, status="http_422"), rec(5, status="error"),
               rec(6, status="timeout"), rec(7)]
    s = summarize(records, 1.0)
    assert (s.rejected_429, s.rejected_503) == (2, 1)
    assert s.http_errors == {"http_500": 1, "http_422": 1}
    assert (s.errors, s.timeouts, s.completed) == (1, 1, 1)


def test_latency_distributions_cover_completed_requests_and_pool_every_gap():
    records = [rec(0, ttft=0.1, itl=[0.01, 0.02]), rec(1, ttft=0.3, itl=[0.03]),
               rec(2, status="http_503")]
    s = summarize(records, 1.0)
    assert s.ttft_s.count == 2 and s.ttft_s.p50 == pytest.approx(0.2)
    assert s.itl_s.count == 3 and s.itl_s.max == pytest.approx(0.03)
    assert s.itl_s.p50 == pytest.approx(0.02)


def test_inexact_lengths_are_counted():
    records = [rec(0, out=10, asked=11), rec(1, out=11, asked=11),
               rec(2, prompt=100, prompt_reported=101), rec(3, prompt=100, prompt_reported=100)]
    s = summarize(records, 1.0)
    assert s.inexact_outputs == 1 and s.inexact_prompts == 1


def test_empty_run_summarizes_to_zeros():
    s = summarize([], wall_s=0.0)
    assert s.request_throughput == 0 and s.goodput == 0 and s.ttft_s == Distribution.of([])


def test_streamed_throughput_includes_tokens_of_unfinished_requests():
    unfinished = RequestRecord(1, "c", "", 10, 100, 0.0, "timeout", ttft_s=0.5, e2e_s=4.0,
                               output_tokens=60)
    s = summarize([rec(0, out=100, asked=100), unfinished], wall_s=4.0)
    assert s.output_throughput == pytest.approx(100 / 4)
    assert s.streamed_output_throughput == pytest.approx(160 / 4)
    assert s.timeouts == 1 and s.completed == 1
