"""bench/ttft_phases.py reads the spans a traced deployment wrote; here a trace file is written
by hand, span for span, in the format SPLITSERVE_TRACE_FILE produces."""

from __future__ import annotations

import json

from bench.ttft_phases import prefill_waves

MS = 1_000_000


def span(trace: str, name: str, start_ms: float, end_ms: float) -> str:
    return json.dumps({"trace_id": trace, "name": name, "start_ns": int(start_ms * MS),
                       "end_ns": int(end_ms * MS)})


def test_requests_whose_prefill_began_together_are_one_wave(tmp_path):
    lines = []
    # A burst: one early request prefilled alone, then two steps of three.
    starts = {"a": (100, 150), "b": (160, 400), "c": (163, 401), "d": (165, 402),
              "e": (405, 700), "f": (406, 705), "g": (409, 703)}
    for i, (trace, (start, end)) in enumerate(starts.items()):
        lines.append(span(trace, "gateway.request", 10 + i, 900))
        lines.append(span(trace, "prefill.forward", start, end))
    lines.append(span("no-prefill", "gateway.request", 5, 20))  # refused: no prefill span
    trace_file = tmp_path / "trace.jsonl"
    trace_file.write_text("\n".join(lines) + "\n")

    assert prefill_waves(trace_file) == [(1, 90.0, 140.0), (3, 150.0, 392.0),
                                                    (3, 395.0, 695.0)]


def test_an_empty_trace_has_no_waves(tmp_path):
    trace_file = tmp_path / "trace.jsonl"
    trace_file.write_text("")
    assert prefill_waves(trace_file) == []
