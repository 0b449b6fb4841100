"""Observability across real processes: one request is one trace whose spans come from the
gateway, the prefill and the decode worker, correctly parented; `/metrics` of the gateway and
of the workers move the right way as requests are served, rejected and cancelled; the gateway
writes one access-log line per request."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import grpc
import httpx
import pytest
from gateway_processes import ServiceProcess
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from splitserve_cli.processes import WorkerProcess, start_worker
from tests.metrics_text import scrape

pytestmark = pytest.mark.timeout(240)

DASHBOARD = Path(__file__).resolve().parents[2] / "k8s/splitserve/dashboards/splitserve.json"

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


class TracedStack:
    """Gateway, prefill and decode, each exporting its spans to its own JSON-lines file."""

    def __init__(self, model: Path, folder: Path) -> None:
        self.files = {name: folder / f"{name}.jsonl" for name in ("gateway", "prefill", "decode")}
        self.model_name = model.name
        self.workers: list[WorkerProcess] = []
        self.gateway: ServiceProcess | None = None
        try:
            for role in ("decode", "prefill"):
                self.workers.append(start_worker(
                    role, model, "--num-kv-blocks", "64",
                    env={"SPLITSERVE_TRACE_FILE": str(self.files[role])}))
            self.decode, self.prefill = self.workers
            self.gateway = ServiceProcess("gateway", [
                "gateway", "--model", str(model), "--port", "0", "--grpc-port", "0",
                "--health-interval-s", "0.2", "--prefill", self.prefill.address,
                "--decode", self.decode.address, "--log-format", "json",
            ], env={"SPLITSERVE_TRACE_FILE": str(self.files["gateway"]),
                    "OTEL_TRACES_SAMPLER": "always_on"}).wait_ready()
            _wait_ready(self.admin_url)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.gateway.admin_address}"

    def spans(self) -> list[dict]:
        return [json.loads(line) for path in self.files.values() if path.exists()
                for line in path.read_text().splitlines()]

    def access_log(self) -> list[dict]:
        entries = [json.loads(line) for line in self.gateway.lines if line.startswith("{")]
        return [e for e in entries if e.get("logger") == "splitserve.access"]

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        for worker in self.workers:
            worker.kill()


@pytest.fixture(scope="module")
def traced(tiny_llama_dir, tmp_path_factory):
    stack = TracedStack(tiny_llama_dir, tmp_path_factory.mktemp("traces"))
    yield stack
    stack.stop()


def test_one_request_is_one_trace_across_the_three_processes(traced):
    response = httpx.post(f"{traced.url}/v1/completions", timeout=60, json={
        "model": traced.model_name, "prompt": list(range(20, 60)), "max_tokens": 6,
        "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]

    def trace_of_request() -> list[dict]:
        spans = traced.spans()
        roots = [s for s in spans if s["name"] == "gateway.request"
                 and s["attributes"]["splitserve.request_id"] == request_id]
        if not roots:
            return []
        return [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]

    needed = {"gateway.request", "gateway.queue", "prefill", "prefill.queue", "prefill.forward",
              "prefill.kv_send", "decode", "decode.kv_wait", "decode.first_step"}
    spans = _poll(trace_of_request, lambda s: needed <= {x["name"] for x in s}, "the spans")
    by_name = {s["name"]: s for s in spans}
    assert {s["service"] for s in spans} == {
        "splitserve-gateway", "splitserve-prefill", "splitserve-decode"}
    root = by_name["gateway.request"]
    assert root["parent_id"] is None
    for child in ("gateway.queue", "prefill", "decode"):
        assert by_name[child]["parent_id"] == root["span_id"], child
    for child in ("prefill.queue", "prefill.forward", "prefill.kv_send"):
        assert by_name[child]["parent_id"] == by_name["prefill"]["span_id"], child
    for child in ("decode.kv_wait", "decode.first_step"):
        assert by_name[child]["parent_id"] == by_name["decode"]["span_id"], child
    attrs = root["attributes"]
    assert attrs["splitserve.tenant"] == "anonymous"
    assert attrs["splitserve.prompt_tokens"] == 40
    assert attrs["splitserve.output_tokens"] == 6
    assert attrs["splitserve.outcome"] == "finished"
    assert attrs["splitserve.transfer_bytes"] == \
        by_name["prefill"]["attributes"]["splitserve.transfer_bytes"] > 0
    assert attrs["splitserve.decode_worker"] and attrs["splitserve.prefill_worker"]
    assert "splitserve.cached_prefix_tokens" in attrs
    # The span file has the request's events: where it went, when its first token came.
    events = {event["name"]: event for event in root["events"]}
    assert {"route", "first_token"} <= set(events), root["events"]
    assert events["route"]["attributes"]["attempt"] == 0  # the first attempt
    assert events["route"]["attributes"]["decode_worker"] == attrs["splitserve.decode_worker"]
    assert root["start_ns"] < events["first_token"]["time_ns"] <= root["end_ns"]
    # The prompt is never logged by default; the access line carries the same trace id.
    (line,) = _poll(lambda: [e for e in traced.access_log() if e["request_id"] == request_id],
                    bool, "the access-log line")
    assert line["trace_id"] == root["trace_id"]
    assert line["outcome"] == "finished" and line["status"] == 200
    assert (line["prompt_tokens"], line["completion_tokens"]) == (40, 6)
    assert line["ttft_s"] <= line["e2e_s"] and line["queue_s"] >= 0
    assert "prompt" not in line


def test_probes_and_scrapes_make_no_traces(traced):
    """FastAPI's own request tracing is off: /metrics, /ready and /health (scraped and probed
    every few seconds) add no span, and a request's spans are only ours."""
    before = {s["span_id"] for s in traced.spans()}
    for url in (f"{traced.admin_url}/metrics", f"{traced.admin_url}/ready",
                f"{traced.admin_url}/health", f"{traced.url}/health", f"{traced.url}/v1/models"):
        assert httpx.get(url, timeout=10).status_code == 200, url
    response = httpx.post(f"{traced.url}/v1/completions", timeout=60, json={
        "model": traced.model_name, "prompt": list(range(70, 90)), "max_tokens": 2,
        "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    spans = _poll(lambda: [s for s in traced.spans() if s["span_id"] not in before],
                  lambda s: any(x["name"] == "gateway.request"
                                and x["attributes"]["splitserve.request_id"] == request_id
                                for x in s), "the request's spans")
    assert [s["name"] for s in spans if not s["name"].startswith(("gateway.", "prefill", "decode"))
            ] == []


def test_an_error_answer_carries_the_request_id_the_access_log_has(traced):
    wrong = httpx.post(f"{traced.url}/v1/completions", timeout=30,
                       headers={"x-request-id": "caller-err-1"},
                       json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    # The caller's id with the gateway's suffix, as on a success.
    request_id = wrong.headers["x-request-id"]
    assert wrong.status_code == 404 and request_id.startswith("caller-err-1-")
    (line,) = _poll(lambda: [e for e in traced.access_log() if e["request_id"] == request_id],
                    bool, "the access-log line")
    assert line["status"] == 404 and line["reason"] == "model_not_found"


def test_a_prompt_refused_for_its_length_logs_its_length(traced):
    """The access log said prompt_tokens 0 for a 400 context_length_exceeded: the prompt was
    refused before admission recorded it. The tiny model's context is 512 tokens."""
    cases = {"too-long-prompt": ({"prompt": list(range(5, 605)), "max_tokens": 1}, 600),
             "too-long-answer": ({"prompt": list(range(5, 15)), "max_tokens": 600}, 10)}
    for request_id, (body, _) in cases.items():
        refused = httpx.post(f"{traced.url}/v1/completions", timeout=30,
                             headers={"x-request-id": request_id},
                             json={"model": traced.model_name, **body})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "context_length_exceeded"
    for request_id, (_, tokens) in cases.items():
        (line,) = _poll(lambda prefix=request_id: [e for e in traced.access_log()
                                                   if e["request_id"].startswith(prefix)],
                        bool, request_id)
        assert line["status"] == 400 and line["prompt_tokens"] == tokens, line


def test_grpc_front_door_continues_the_callers_trace(traced):
    async def call() -> list[gateway_pb2.GenerateTextResponse]:
        async with grpc.aio.insecure_channel(traced.gateway.field("grpc")) as channel:
            stream = gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateTextRequest(
                    request_id="grpc-traced", token_ids=gateway_pb2.TokenIds(ids=range(30, 50)),
                    sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0,
                                                       has_temperature=True, ignore_eos=True)),
                metadata=[("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")])
            return [r async for r in stream]

    assert sum(len(r.token_ids) for r in asyncio.run(call())) == 4
    needed = {"gateway.request", "prefill", "decode"}
    spans = _poll(lambda: [s for s in traced.spans() if s["trace_id"] == CLIENT_TRACE],
                  lambda s: needed <= {x["name"] for x in s}, "the spans")
    by_name = {s["name"]: s for s in spans}
    assert by_name["gateway.request"]["parent_id"] == CLIENT_SPAN
    assert by_name["gateway.request"]["attributes"]["splitserve.api"] == "grpc"
    assert by_name["prefill"]["parent_id"] == by_name["gateway.request"]["span_id"]
    assert by_name["decode"]["parent_id"] == by_name["gateway.request"]["span_id"]


def test_metrics_follow_served_rejected_and_cancelled_requests(traced):
    gateway_url = traced.url
    who = {"model": traced.model_name, "tenant": "anonymous"}
    before = scrape(traced.admin_url)
    prompts = [list(range(100 * i + 10, 100 * i + 40)) for i in range(3)]

    def complete(prompt: list[int], stream: bool) -> int:
        body = {"model": traced.model_name, "prompt": prompt, "max_tokens": 5,
                "temperature": 0, "ignore_eos": True, "stream": stream}
        response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        return 5

    served_tokens = sum(complete(p, stream=i % 2 == 1) for i, p in enumerate(prompts))
    served = scrape(traced.admin_url)
    moved = _delta(before, served)
    assert moved[series("splitserve_gateway_ttft_seconds_count", **who)] == 3
    assert moved[series("splitserve_gateway_e2e_latency_seconds_count", **who)] == 3
    assert moved[series("splitserve_gateway_time_per_output_token_seconds_count", **who)] == 3
    # Every output token after a choice's first has one inter-token gap.
    assert moved[series("splitserve_gateway_itl_seconds_count", **who)] == served_tokens - 3
    assert moved[series("splitserve_gateway_requests_total", **who, outcome="finished",
                        reason="length")] == 3
    assert moved['splitserve_gateway_served_tokens_total{kind="output",tenant="anonymous"}'] \
        == served_tokens
    assert moved['splitserve_gateway_served_tokens_total{kind="prompt",tenant="anonymous"}'] == 90
    routed = {k: v for k, v in moved.items()
              if k.startswith("splitserve_gateway_routing_decisions_total")}
    assert routed == {
        series("splitserve_gateway_routing_decisions_total", role="decode",
               worker=traced.decode.address, reason="disaggregated"): 3,
        series("splitserve_gateway_routing_decisions_total", role="prefill",
               worker=traced.prefill.address, reason="disaggregated"): 3}
    assert served["splitserve_gateway_inflight_requests"] == 0
    # Idle, the decode worker's own batch limit (max_num_seqs), not lowered by its pace.
    assert served["splitserve_gateway_inflight_limit"] == 128

    # A rejected request and a client that leaves mid-stream.
    wrong = httpx.post(f"{gateway_url}/v1/completions", timeout=30,
                       json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert wrong.status_code == 404
    body = {"model": traced.model_name, "prompt": list(range(500, 540)), "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gateway_url}/v1/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    disconnects = series("splitserve_gateway_client_disconnects_total", **who,
                         stage="after_first_token")
    after = _poll(lambda: scrape(traced.admin_url), lambda m: m.get(disconnects, 0) >= 1,
                  "the disconnect to be counted")
    moved = _delta(served, after)
    outcomes = {k: v for k, v in moved.items()
                if k.startswith("splitserve_gateway_requests_total") and v}
    assert outcomes == {
        series("splitserve_gateway_requests_total", **who, outcome="rejected",
               reason="model_not_found"): 1,
        series("splitserve_gateway_requests_total", **who, outcome="cancelled",
               reason="client_disconnected"): 1}
    assert moved[disconnects] == 1
    assert moved[series("splitserve_gateway_ttft_seconds_count", **who)] == 1
    assert moved[series("splitserve_gateway_e2e_latency_seconds_count", **who)] == 0

    # The workers: KV returns to zero once idle, transfers and computed tokens counted.
    decode_metrics = _poll(lambda: scrape(f"http://{traced.decode.metrics_address}"),
                           lambda m: m['splitserve_worker_running_requests{role="decode"}'] == 0
                           and m['splitserve_kv_blocks_used{role="decode"}'] == 0,
                           "the decode worker to be idle")
    assert decode_metrics['splitserve_kv_usage_ratio{role="decode"}'] == 0
    assert 'splitserve_worker_token_interval_seconds{role="decode"}' in decode_metrics
    assert decode_metrics['splitserve_kv_transfers_total{role="decode"}'] >= 3
    prefill_metrics = scrape(f"http://{traced.prefill.metrics_address}")
    assert prefill_metrics['splitserve_kv_transfer_bytes_total{role="prefill"}'] > 0
    assert prefill_metrics['splitserve_worker_computed_tokens_total{role="prefill"}'] >= 3 * 30

    # Every series the Grafana dashboard queries is one these processes export.
    exported = set().union(*(families(url) for url in (
        traced.admin_url, f"http://{traced.decode.metrics_address}",
        f"http://{traced.prefill.metrics_address}")))
    queried = {re.sub(r"_bucket$", "", name)
               for name in re.findall(r"splitserve_\w+", DASHBOARD.read_text())}
    assert queried and queried <= exported, queried - exported

    # One access-log line per request, the rejected and the cancelled one included.
    entries = {e["request_id"]: e for e in traced.access_log()}
    outcomes_logged = [e["outcome"] for e in entries.values()]
    assert outcomes_logged.count("rejected") >= 1 and outcomes_logged.count("cancelled") >= 1


def series(name: str, **labels: str) -> str:
    """A sample's name as the text format writes it (labels sorted by name)."""
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def families(url: str) -> set[str]:
    """Metric families a process declares (`# TYPE` lines), samples or not."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def _poll(read, done, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; last: {value}")
        time.sleep(0.1)


def _wait_ready(url: str) -> None:
    _poll(lambda: httpx.get(f"{url}/ready", timeout=5).status_code, lambda s: s == 200,
          "the gateway to be ready", timeout=60)
