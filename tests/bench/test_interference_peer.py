"""bench/interference_peer.py's report: ratios against vLLM from the same run, refusals shown
beside the latencies, a system that did not start reported as such."""

from __future__ import annotations

from bench.interference_peer import report


def _row(itl_p99, ttft_p50, refused_long=0):
    return {"steady": {"served": 40, "sent": 40, "refused": 0,
                       "itl_ms": {"p50": 30.0, "p99": itl_p99}, "tpot_ms_p50": 30.0},
            "long": {"served": 30 - refused_long, "sent": 30, "refused": refused_long,
                     "ttft_ms": {"p50": ttft_p50, "p99": ttft_p50 * 2}},
            "cpu": {"foreign_cpu_share": 0.02}}


def test_ratios_are_against_vllm_and_refusals_are_shown():
    text = report({"systems": {"splitserve-disagg": _row(100.0, 2000.0, refused_long=5),
                               "splitserve-agg": {"error": "did not start: boom"},
                               "vllm": _row(1000.0, 2500.0)}})
    assert "| splitserve-disagg | 30 / 100 | 2,000 / 4,000 | 40 / 0 | 25 / 5 | 2% |" in text
    assert "| splitserve-disagg | 0.10x | 0.80x |" in text
    assert "did not start: boom" in text


def test_without_vllm_there_is_no_ratio_table():
    text = report({"systems": {"splitserve-disagg": _row(100.0, 2000.0)}})
    assert "vLLM" not in text
