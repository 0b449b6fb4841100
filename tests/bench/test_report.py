"""The comparison's derived targets and its report, from synthetic sweep results."""

from __future__ import annotations

import pytest

from bench.compare.report import render
from bench.compare.targets import RateBound, max_sustainable_rate, peak_goodput
from bench.loadgen.metrics import SLO, RequestRecord, summarize


def point(system, workload, rate, ttft_p99, goodput=1.0, timeouts=0, out_tput=10.0,
          itl_p99=0.02):
    """A sweep point in results.json form: a real Summary's layout with chosen headline values."""
    records = [RequestRecord(i, "steady", "", 64, 10, 0.0, "ok", ttft_s=0.1, itl_s=(0.01,),
                             e2e_s=0.5, output_tokens=10) for i in range(10)]
    records += [RequestRecord(10 + i, "steady", "", 64, 10, 0.0, "timeout")
                for i in range(timeouts)]
    s = summarize(records, wall_s=10.0, slo=SLO()).to_json()
    s["ttft_s"]["p99"], s["goodput"], s["output_throughput"] = ttft_p99, goodput, out_tput
    s["itl_s"]["p99"] = itl_p99
    return {"system": system, "workload": workload, "rate": rate, "summary": s,
            "by_class": {"steady": s}}


def test_sustainable_rate_interpolates_where_ttft_p99_crosses_the_target():
    pts = [point("a", "chat", r, t) for r, t in ((0.5, 0.3), (1.0, 0.8), (2.0, 1.8), (4.0, 9.0))]
    bound = max_sustainable_rate(pts, 1.0)
    assert (bound.low, bound.high) == (1.0, 2.0)
    assert bound.estimate == pytest.approx(1.2)


def test_sustainable_rate_reports_open_ends_honestly():
    assert max_sustainable_rate([point("a", "chat", 1.0, 0.2), point("a", "chat", 2.0, 0.5)],
                                1.0) == RateBound(2.0, None, None)
    assert max_sustainable_rate([point("a", "chat", 1.0, 3.0)], 1.0) == RateBound(None, 1.0, None)


def test_a_point_with_timeouts_counts_as_past_the_target_without_an_estimate():
    pts = [point("a", "chat", 1.0, 0.5), point("a", "chat", 2.0, 0.6, timeouts=3)]
    assert max_sustainable_rate(pts, 1.0) == RateBound(1.0, 2.0, None)


def test_peak_goodput_picks_the_best_rate():
    pts = [point("a", "chat", 1.0, 0.1, goodput=0.9), point("a", "chat", 2.0, 0.1, goodput=1.8),
           point("a", "chat", 4.0, 0.1, goodput=0.3)]
    assert peak_goodput(pts) == (1.8, 2.0)


def results():
    systems = {"splitserve-disagg": {"label": "splitserve disaggregated", "flavor": "openai"},
               "splitserve-agg": {"label": "splitserve aggregated", "flavor": "openai"},
               "transformers-serve": {"label": "transformers serve (CB)", "flavor": "transformers"}}
    pts = [point("splitserve-disagg", "chat", r, t) for r, t in ((1.0, 0.2), (2.0, 0.4), (4.0, 1.4))]
    pts += [point("transformers-serve", "chat", r, t, goodput=0.5)
            for r, t in ((1.0, 0.6), (2.0, 3.0))]
    pts += [point("splitserve-disagg", "burst", None, 0.3, out_tput=20.0),
            point("transformers-serve", "burst", None, 0.3, out_tput=10.0)]
    pts += [point("splitserve-disagg", "interference", 1.0, 0.2, itl_p99=0.02),
            point("splitserve-agg", "interference", 1.0, 0.2, itl_p99=0.06)]
    workloads = [{"name": n, "about": n, "rates": [], "burst": 0, "duration_s": 10,
                  "workload": n, "systems": [], "endpoint": "completions"}
                 for n in ("burst", "chat", "interference")]
    return {"plan": {"quick": True, "model_dir": "m", "slo": {"ttft_s": 1.0, "tpot_s": 0.1},
                     "workloads": workloads},
            "started": "t0", "finished": "t1", "systems": systems, "points": pts,
            "machine": {"cores": 2, "cpu": "cpu", "torch": "x", "transformers": "y",
                        "commit": "abc"}}


def test_report_has_the_targets_a_table_per_workload_and_plots(tmp_path):
    path = render(results(), tmp_path)
    text = path.read_text()
    # aggregated (the middle column) ran no burst or chat points here
    assert "| burst output throughput (tok/s) | 20.0 | - | 10.0 | 2.00x |" in text
    assert "| 1.00 (at 1) | 0.00 | 0.50 (at 1) | 2.00x |" in text  # peak goodput and its ratio
    # TTFT p99 crosses 1 s at 2 + (1 - 0.4) / (1.4 - 0.4) * 2 = 3.2 and 1 + 0.4 / 2.4 = 1.17
    assert "~3.20 req/s, between 2 and 4 req/s" in text
    assert "~1.17 req/s, between 1 and 2 req/s" in text
    assert "| 2.74x |" in text
    assert "| ITL p99 ms | 20 | 60 | 3.00x |" in text
    for workload in ("burst", "chat", "interference"):
        assert f"## Workload `{workload}`" in text
    for panel in ("ttft_p99", "itl_p99", "throughput", "goodput"):
        png = tmp_path / f"chat_{panel}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png.name})" in text
    assert not (tmp_path / "interference_goodput.png").exists()  # one rate: nothing to plot


def test_report_lists_the_settings_and_counts_refusals(tmp_path):
    from bench.compare.systems import ServeOptions, serve_settings

    data = results()
    data["plan"]["settings"] = serve_settings(ServeOptions(dtype="bfloat16",
                                                           dtype_reason="same as the peer")).to_json()
    data["points"][0]["summary"]["rejected_503"] = 3
    text = render(data, tmp_path).read_text()
    assert "## Settings" in text
    assert "- bench.compare: gateway admission: ttft_target_s=1 [default]" in text
    assert "- override: workers SPLITSERVE_DTYPE bfloat16 (shipped: auto" in text
    assert "| burst and chat requests refused (429 + 503) / sent, all points | 3 / 40 |" in text


def test_report_says_when_the_measured_code_had_uncommitted_changes(tmp_path):
    data = results()
    assert "uncommitted" not in render(data, tmp_path).read_text()
    data["machine"]["uncommitted"] = ["services/gateway/config.py"]
    text = render(data, tmp_path).read_text()
    assert "commit abc **plus uncommitted changes to 1 path(s) of the measured code" in text
    assert "`services/gateway/config.py`" in text


def interleaved_results():
    """Three rounds of a burst: splitserve's throughput 20 / 30 / 25 tok/s against the peer's
    10 / 40 / 20 in the same rounds (ratios 2.0, 0.75, 1.25)."""
    data = results()
    data["plan"]["rounds"] = 3
    data["points"] = []
    for r, (ours, theirs) in enumerate(((20.0, 10.0), (30.0, 40.0), (25.0, 20.0)), start=1):
        for system, tput in (("splitserve-disagg", ours), ("transformers-serve", theirs)):
            data["points"].append({**point(system, "burst", None, 0.3, out_tput=tput), "round": r})
    return data


def test_median_rounds_keeps_each_points_median_round():
    from bench.compare.rounds import median_rounds

    kept = median_rounds(interleaved_results())["points"]
    assert {(p["system"], p["round"], p["summary"]["output_throughput"]) for p in kept} == {
        ("splitserve-disagg", 3, 25.0), ("transformers-serve", 3, 20.0)}
    plain = results()
    assert median_rounds(plain) is plain  # a run without rounds is left as it is


def test_median_rounds_takes_the_worse_middle_of_an_even_count():
    from bench.compare.rounds import median_rounds

    data = interleaved_results()
    data["points"] = [p for p in data["points"] if p["round"] < 3]  # 20 and 30 tok/s
    kept = {p["system"]: p["summary"]["output_throughput"] for p in median_rounds(data)["points"]}
    assert kept == {"splitserve-disagg": 20.0, "transformers-serve": 10.0}


def test_an_interleaved_report_lists_every_round_and_the_median_ratio(tmp_path):
    text = render(interleaved_results(), tmp_path).read_text()
    assert "Interleaved: every system was up at once" in text
    assert "## Rounds" in text
    assert "| burst | out tok/s | 1 | 20.0 | 10.0 | 2.00x |" in text
    assert "| burst | out tok/s | 2 | 30.0 | 40.0 | 0.75x |" in text
    assert "| burst | out tok/s | median |  |  | **1.25x** |" in text
    # the targets and the workload table show the median round (25 against 20)
    assert "| burst output throughput (tok/s) | 25.0 | - | 20.0 | 1.25x | n/a |" in text
    assert (tmp_path / "rounds.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![rounds](rounds.png)" in text
