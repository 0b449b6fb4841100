"""bench/flood_fairness.py's light_phases reads the spans of a traced deployment (the format
SPLITSERVE_TRACE_FILE writes, written by hand here): only the shortest prompt's requests
(light's) after the flood began count, each phase from its spans' edges."""

from __future__ import annotations

import json

from bench.flood_fairness import light_phases

MS = 1_000_000


def span(trace: str, name: str, start_ms: float, end_ms: float, prompt_tokens: int = 0) -> str:
    attributes = {"splitserve.prompt_tokens": prompt_tokens} if prompt_tokens else {}
    return json.dumps({"trace_id": trace, "name": name, "start_ns": int(start_ms * MS),
                       "end_ns": int(end_ms * MS), "attributes": attributes})


def request(trace: str, at: float, prompt_tokens: int) -> list[str]:
    return [span(trace, "gateway.request", at, at + 500, prompt_tokens),
            span(trace, "decode.kv_wait", at + 50, at + 90),
            span(trace, "prefill.queue", at + 55, at + 60),
            span(trace, "prefill.forward", at + 60, at + 80),
            span(trace, "decode.first_step", at + 90, at + 180)]


def test_light_requests_after_the_flood_began_are_read_phase_by_phase(tmp_path):
    lines = [*request("before", 0, 7),  # light alone: before the flood
             *request("light", 1000, 7), *request("heavy", 1000, 34),
             span("queued", "gateway.request", 2000, 2900, 7),
             span("queued", "gateway.queue", 2000, 2030)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")

    phases = light_phases(trace, since_ns=900 * MS)

    assert phases == {"gateway queue": [30.0], "decode reservation": [50.0],
                      "prefill queue": [5.0], "prefill forward": [20.0],
                      "KV to decode cache": [10.0], "decode first step": [90.0]}
