"""The client and runner against a real local SSE server with known pacing: timings, SSE
parsing, statuses, flavors, headers, arrival scheduling and the drain deadline."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from bench.loadgen.arrivals import Burst, ClosedLoop, Poisson
from bench.loadgen.client import Target, send
from bench.loadgen.prompts import BuiltPrompt
from bench.loadgen.runner import RunConfig, run_load
from bench.loadgen.sse import parse_events
from bench.loadgen.workload import RequestSpec, Tenant, preset, with_tenants


class WordPrompts:
    """Prompt source without a tokenizer: a fixed text per request, or per index."""

    def __init__(self, text: str = "hello", by_index: dict[int, str] | None = None) -> None:
        self.text, self.by_index = text, by_index or {}

    def build(self, spec, rng, prefix_len=0):
        return BuiltPrompt(self.by_index.get(spec.index, self.text), spec.prompt_len)


def one(server, prompt="hello", n=5, endpoint="completions", flavor="openai", deadline=None,
        api_key="", sampling=()):
    async def go():
        async with httpx.AsyncClient(timeout=30) as client:
            target = Target(server.url, "fake-model", endpoint, flavor)
            spec = RequestSpec(0, "c", 7, n, api_key=api_key, sampling=sampling)
            if deadline is not None:
                at = asyncio.get_running_loop().time() + deadline
                return await send(client, target, spec, prompt, 0.0, at)
            return await send(client, target, spec, prompt, 0.0)
    return asyncio.run(go())


# -- SSE parsing -------------------------------------------------------------------------------


def test_sse_events_split_on_blank_lines_skip_comments_and_stop_at_done():
    lines = [": keep-alive", "data: {\"a\": 1}", "", "event: x", "data: line1", "data:line2", "",
             "data: {\"b\": 2}\r", "\r", "data: [DONE]", "", "data: after"]
    assert parse_events(lines) == ['{"a": 1}', "line1\nline2", '{"b": 2}']


def test_sse_last_event_counts_even_without_a_closing_blank_line():
    assert parse_events(["data: x", "", "data: y"]) == ["x", "y"]


# -- one request -------------------------------------------------------------------------------


def test_timings_follow_the_servers_pacing(server):
    server.reset(ttft_s=0.2, itl_s=0.05)
    r = one(server, n=6)
    assert r.ok, r.error
    assert 0.2 <= r.ttft_s < 1.0
    # A stalled client may read two chunks at once (one tiny gap), but it cannot see the last
    # token before the server has paced all of them out.
    assert len(r.itl_s) == 5 and 4 * 0.05 <= sum(r.itl_s) < 1.5
    assert r.output_tokens == 6 and r.prompt_tokens_reported == 7
    assert r.e2e_s >= r.ttft_s + sum(r.itl_s) - 1e-6
    assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 5)


def test_stream_without_done_still_completes(server):
    server.reset(send_done=False)
    r = one(server, n=4)
    assert r.ok and r.output_tokens == 4


def test_chat_endpoint_reads_delta_content(server):
    messages = [{"role": "user", "content": "hello"}]
    r = one(server, prompt=messages, n=3, endpoint="chat")
    assert r.ok and len(r.itl_s) == 2
    assert server.bodies[-1]["messages"] == messages


@pytest.mark.parametrize("prompt, status", [("reject429", "http_429"), ("reject503", "http_503")])
def test_overload_answers_are_recorded_by_status(server, prompt, status):
    r = one(server, prompt=prompt)
    assert r.status == status and not r.ok and "busy" in r.error


def test_an_error_event_mid_stream_fails_the_request(server):
    r = one(server, prompt="break", n=5)
    assert r.status == "error" and "worker died" in r.error
    assert r.ttft_s is not None and len(r.itl_s) == 1  # two tokens arrived before it


def test_unreachable_server_is_an_error_not_an_exception():
    r = one(type("S", (), {"url": "http://127.0.0.1:9"})())
    assert r.status == "error" and "Connect" in r.error


def test_deadline_turns_a_slow_stream_into_a_timeout(server):
    server.reset(ttft_s=0.05, itl_s=0.5)
    r = one(server, n=20, deadline=0.4)
    assert r.status == "timeout" and r.ttft_s is not None


# -- flavors and headers -----------------------------------------------------------------------


def test_openai_flavor_asks_for_exact_lengths_with_ignore_eos(server):
    one(server, n=9)
    body = server.bodies[-1]
    assert body["ignore_eos"] is True and body["max_tokens"] == 9 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_a_request_class_sampling_goes_in_the_body_over_the_targets_temperature(server):
    one(server, sampling=(("temperature", 0.8), ("top_p", 0.95), ("logprobs", 2)))
    body = server.bodies[-1]
    assert (body["temperature"], body["top_p"], body["logprobs"]) == (0.8, 0.95, 2)
    one(server, endpoint="chat", sampling=(("logprobs", 2),))
    body = server.bodies[-1]
    assert body["logprobs"] is True and body["top_logprobs"] == 2


def test_transformers_flavor_sends_a_generation_config_instead(server):
    server.reset(reject_ignore_eos=True)
    assert one(server, flavor="openai").status == "http_422"
    r = one(server, n=9, flavor="transformers")
    assert r.ok
    body = server.bodies[-1]
    assert "ignore_eos" not in body
    assert json.loads(body["generation_config"]) == {"max_new_tokens": 9, "eos_token_id": -1}


def test_api_keys_go_in_a_bearer_header(server):
    server.reset(api_keys=("k1",))
    assert one(server, api_key="k1").ok
    assert server.headers[-1]["authorization"] == "Bearer k1"
    assert one(server, api_key="nope").status == "http_401"


# -- runs --------------------------------------------------------------------------------------


def run(server, arrivals, duration=1.0, n=None, workload=None, prompts=None, drain=30.0):
    config = RunConfig(Target(server.url, "fake-model"), workload or preset("fixed", output_len=4),
                       arrivals, duration_s=duration, num_requests=n, seed=0, progress=False,
                       drain_timeout_s=drain)
    return asyncio.run(run_load(config, prompts or WordPrompts()))


def test_poisson_run_sends_the_scheduled_requests_on_time(server):
    server.reset(ttft_s=0.01, itl_s=0.01)
    expected = Poisson(10.0).times(2.0, np.random.default_rng(
        np.random.SeedSequence(0).spawn(3)[0]))
    result = run(server, Poisson(10.0), duration=2.0)
    assert result.summary.requests == len(expected) == len(server.bodies)
    assert result.summary.completed == len(expected)
    lateness = np.array([r.start_s for r in result.records]) - expected
    assert np.all(lateness > -0.005)  # never early
    assert np.median(lateness) < 0.05 and result.send_lag_s.count == len(expected)
    assert result.summary.output_throughput > 0


def test_closed_loop_keeps_exactly_concurrency_requests_in_flight(server):
    server.reset(ttft_s=0.05, itl_s=0.02)
    result = run(server, ClosedLoop(3), duration=60.0, n=12)
    assert result.summary.completed == 12
    assert server.peak_in_flight == 3


def test_a_refused_closed_loop_client_waits_the_retry_after_before_its_next_request(server):
    server.reset(ttft_s=0.01, itl_s=0.01)
    prompts = WordPrompts(by_index={0: "reject503"})
    result = run(server, ClosedLoop(1), duration=60.0, n=3, prompts=prompts)
    refused, after, last = result.records
    assert refused.status == "http_503" and refused.retry_after_s == 1.0
    assert after.start_s - refused.start_s >= 0.95, "resent before the server's Retry-After"
    assert after.ok and after.retry_after_s is None
    assert last.start_s - after.start_s < 0.9, "a served request made the client wait"


def test_rejections_and_successes_mix_in_one_summary(server):
    prompts = WordPrompts(by_index={1: "reject429", 3: "reject503"})
    result = run(server, Burst(5), prompts=prompts)
    s = result.summary
    assert (s.completed, s.rejected_429, s.rejected_503) == (3, 1, 1)


def test_tenant_keys_reach_the_server(server):
    workload = with_tenants(preset("fixed", output_len=2), (Tenant("a", "ka"), Tenant("b", "kb")))
    result = run(server, Burst(20), workload=workload)
    sent = [h["authorization"] for h in server.headers]
    assert set(sent) == {"Bearer ka", "Bearer kb"}
    assert {r.tenant for r in result.records} == {"a", "b"}


def test_unfinished_requests_time_out_at_the_drain_deadline(server):
    server.reset(ttft_s=0.01, itl_s=0.3)
    result = run(server, Burst(2), workload=preset("fixed", output_len=50), drain=0.5)
    assert result.summary.timeouts == 2 and result.wall_s < 5
