"""bench/serving_overhead.py's arithmetic: the decode window's ITL, py-spy's collapsed stacks,
and the per-mode summary (hand-off and slowdown)."""

from __future__ import annotations

import pytest

from bench.serving_overhead import Round, summarize, top_leaves, window_itl


def test_window_itl_counts_only_the_tokens_inside_the_window():
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    counts = [1, 1, 2, 1, 1, 1]
    # inside [1, 4]: arrivals at 1, 2, 3, 4 carrying 1, 2, 1, 1 tokens: 4 tokens after the first
    assert window_itl(times, counts, 1.0, 4.0) == pytest.approx(3.0 / 4)
    assert window_itl(times, counts, 4.5, 4.9) is None


def test_top_leaves_ranks_the_functions_on_top_of_the_stack():
    collapsed = "main;loop;write 30\nmain;loop;select 60\nmain;step 10\nnot a stack line\n"
    assert top_leaves(collapsed, n=2) == [("select", 0.6), ("write", 0.3)]
    assert top_leaves("") == []


def test_summary_separates_hand_off_from_the_gateways_slowdown_of_the_step():
    def rnd(layer, step, itl):
        return Round("agg", 1, layer, itl, step, 100, {"gateway": 0.5 if layer == "http" else 0.0})

    rounds = [rnd("grpc", 10.0, 10.1), rnd("grpc", 10.0, 10.1), rnd("http", 11.0, 11.3)]
    (row,) = summarize(rounds)
    assert row["grpc_handoff_ms"] == pytest.approx(0.1)
    assert row["http_handoff_ms"] == pytest.approx(0.3)
    assert row["step_slowdown"] == pytest.approx(1.1)
    assert row["http_itl_over_grpc_step"] == pytest.approx(1.13)
    assert row["cpu_ms_per_token_http"] == {"gateway": 0.5}
