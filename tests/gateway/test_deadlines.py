"""Time bounds at the gateway, with a real gateway process in front of scripted workers that
hang: the inter-token stall timeout and the request deadline (flag, caller's header, gRPC)
end a stream with an error (504 before any output), wherever the request is stuck, and
cancel its worker RPC, which is what frees its KV on a real worker."""

from __future__ import annotations

import json
import os
import signal
import time

import grpc
import httpx
import pytest
from fake_workers import FakeDecode, hangs
from gateway_processes import start_worker, worker_stats
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# Well above the timeouts the tests set (0.5-1 s), well below "hung forever".
CLIENT_TIMEOUT_S = 20.0


@pytest.fixture
def model(tiny_llama_dir) -> str:
    return tiny_llama_dir.name


def _stream(url: str, body: dict, headers: dict | None = None) -> tuple[int, list]:
    with httpx.stream("POST", f"{url}/v1/completions", timeout=CLIENT_TIMEOUT_S,
                      json={**body, "stream": True}, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, [response.json()]
        return 200, [line.removeprefix("data: ") for line in response.iter_lines()
                     if line.startswith("data: ")]


def _ends_with_error_event(events: list, code: str) -> str:
    """The SSE ending of a failure after output; returns the streamed text."""
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["code"] == code and error["type"] == "server_error", error
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "error"
    return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])


def test_a_stream_that_stalls_ends_with_an_error_and_its_rpc_is_cancelled(
        servers, gateway_factory, model):
    worker = servers(FakeDecode(hangs(after_tokens=[40, 41], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address, "--stall-timeout-s", "0.5")
    url = f"http://{gateway.address}"
    started = time.monotonic()
    status, events = _stream(url, {"model": model, "prompt": "hi", "max_tokens": 50})
    assert status == 200
    assert _ends_with_error_event(events, "stream_stalled")  # the two tokens, then the error
    assert time.monotonic() - started < CLIENT_TIMEOUT_S / 2
    assert worker.servicer.cancelled.wait(5), "the stalled worker RPC was not cancelled"
    # Not streaming: nothing was sent, so the stall is a 504 with OpenAI's body.
    worker.servicer.cancelled.clear()
    whole = httpx.post(f"{url}/v1/completions", timeout=CLIENT_TIMEOUT_S,
                       json={"model": model, "prompt": "hi", "max_tokens": 50})
    assert whole.status_code == 504, whole.text
    assert whole.json()["error"]["code"] == "stream_stalled"
    assert worker.servicer.cancelled.wait(5)


def test_the_callers_header_lowers_the_deadline_before_and_after_the_first_token(
        servers, gateway_factory, model):
    def by_max_tokens(request, context, fake):
        after = [40, 41] if request.sampling.max_tokens == 20 else []
        yield from hangs(after_tokens=after, start_index=0)(request, context, fake)

    worker = servers(FakeDecode(by_max_tokens, role="both"))
    gateway = gateway_factory("--worker", worker.address)  # default: 600 s, stall 90 s
    url = f"http://{gateway.address}"
    header = {"x-request-timeout-s": "0.5"}
    # Stuck before its first token: no 200 was committed, so the stream is a 504.
    status, (body,) = _stream(url, {"model": model, "prompt": "hi", "max_tokens": 10}, header)
    assert status == 504 and body["error"]["code"] == "request_timeout", body
    assert worker.servicer.cancelled.wait(5)
    worker.servicer.cancelled.clear()
    # Stuck after two tokens: the stream ends with the error event.
    status, events = _stream(url, {"model": model, "prompt": "hi", "max_tokens": 20}, header)
    assert status == 200 and _ends_with_error_event(events, "request_timeout")
    assert worker.servicer.cancelled.wait(5)
    worker.servicer.cancelled.clear()
    # Not streamed, the same 504 tells OpenAI's SDKs not to run it again (they retry every
    # 5xx otherwise: three times the deadline, three times the work).
    response = httpx.post(f"{url}/v1/completions", timeout=CLIENT_TIMEOUT_S, headers=header,
                          json={"model": model, "prompt": "hi", "max_tokens": 10})
    assert response.status_code == 504 and response.headers["x-should-retry"] == "false"
    assert worker.servicer.cancelled.wait(5)
    # A header that is not a positive number of seconds is the caller's mistake.
    for bad in ("soon", "0", "-3", "nan", "inf"):
        response = httpx.post(f"{url}/v1/completions", timeout=CLIENT_TIMEOUT_S,
                              headers={"x-request-timeout-s": bad},
                              json={"model": model, "prompt": "hi"})
        assert response.status_code == 400, (bad, response.text)
        assert response.json()["error"]["param"] == "x-request-timeout-s"


def test_a_header_cannot_raise_the_servers_deadline_and_grpc_gets_deadline_exceeded(
        servers, gateway_factory, model):
    worker = servers(FakeDecode(hangs(), role="both"))
    gateway = gateway_factory("--worker", worker.address, "--request-timeout-s", "0.5")
    started = time.monotonic()
    response = httpx.post(f"http://{gateway.address}/v1/completions", timeout=CLIENT_TIMEOUT_S,
                          headers={"x-request-timeout-s": "3600"},
                          json={"model": model, "prompt": "hi", "max_tokens": 10})
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
    assert time.monotonic() - started < CLIENT_TIMEOUT_S / 2
    assert worker.servicer.cancelled.wait(5)
    worker.servicer.cancelled.clear()
    with grpc.insecure_channel(gateway.field("grpc")) as channel, \
            pytest.raises(grpc.RpcError) as caught:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateTextRequest(text="hi"), timeout=CLIENT_TIMEOUT_S))
    # The gateway's own deadline, well before the caller's 20 s one.
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "deadline" in caught.value.details()
    assert worker.servicer.cancelled.wait(5)


def test_a_request_queued_past_its_deadline_gets_504_and_leaves_the_queue(
        servers, gateway_factory, model):
    def by_max_tokens(request, context, fake):
        yield from hangs(after_tokens=[40] if request.sampling.max_tokens == 99 else [],
                         start_index=0)(request, context, fake)

    worker = servers(FakeDecode(by_max_tokens, role="both"))
    # One request in flight at a time, strictly (fcfs: no fair-share overdraft), and no
    # TTFT-based rejection: the second one queues until its own deadline.
    gateway = gateway_factory("--worker", worker.address, "--max-inflight", "1",
                              "--fairness", "fcfs", "--ttft-target-s", "0")
    url = f"http://{gateway.address}/v1/completions"
    with httpx.stream("POST", url, timeout=CLIENT_TIMEOUT_S, json={
            "model": model, "prompt": "hi", "max_tokens": 99, "stream": True}) as held:
        assert held.status_code == 200
        lines = held.iter_lines()  # kept: a dropped iterator would close the connection
        next(lines)  # in flight now, holding the only slot
        queued = httpx.post(url, timeout=CLIENT_TIMEOUT_S,
                            headers={"x-request-timeout-s": "0.5"},
                            json={"model": model, "prompt": "hi", "max_tokens": 5})
        assert queued.status_code == 504, queued.text
        assert "queued" in queued.json()["error"]["message"]
        assert len(worker.servicer.calls) == 1  # it never reached the worker
        # It left the queue; the held request still has the slot.
        assert _gauges(gateway, "splitserve_gateway_queued_requests") == [0.0]
        assert _gauges(gateway, "splitserve_gateway_inflight_requests") == [1.0]


def _gauges(gateway, name: str) -> list[float]:
    text = httpx.get(f"http://{gateway.admin_address}/metrics", timeout=10).text
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")]


def test_grpc_stall_after_output_ends_with_an_error_message_not_a_status(
        servers, gateway_factory):
    worker = servers(FakeDecode(hangs(after_tokens=[40, 41], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address, "--stall-timeout-s", "0.5")
    with grpc.insecure_channel(gateway.field("grpc")) as channel:
        responses = list(gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateTextRequest(
                text="hi", sampling=common_pb2.SamplingParams(max_tokens=50)),
            timeout=CLIENT_TIMEOUT_S))
    assert [t for r in responses for t in r.token_ids] == [40, 41]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert "stall" in responses[-1].error
    assert worker.servicer.cancelled.wait(5)


@pytest.fixture
def frozen_worker(tiny_llama_dir):
    """A real role-both worker of this test's own, which the test may freeze (SIGSTOP)."""
    worker = start_worker(tiny_llama_dir, "both").wait_ready()
    yield worker
    os.kill(worker.process.pid, signal.SIGCONT)  # our own child, by its handle
    worker.stop()


def test_a_stream_stuck_on_a_frozen_worker_is_cut_off_and_the_worker_frees_its_kv(
        frozen_worker, gateway_factory, model):
    gateway = gateway_factory("--worker", frozen_worker.address, "--stall-timeout-s", "0.5")
    baseline = worker_stats(frozen_worker.address)
    events = []
    with httpx.stream("POST", f"http://{gateway.address}/v1/completions",
                      timeout=CLIENT_TIMEOUT_S, json={
                          "model": model, "prompt": "hi", "max_tokens": 400,
                          "ignore_eos": True, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
            if len(events) == 3:  # mid-stream: freeze the worker, wherever it is
                os.kill(frozen_worker.process.pid, signal.SIGSTOP)
    os.kill(frozen_worker.process.pid, signal.SIGCONT)
    _ends_with_error_event(events, "stream_stalled")
    # Thawed, the worker finds its RPC cancelled, aborts the request and frees its blocks.
    deadline = time.monotonic() + CLIENT_TIMEOUT_S
    while True:
        stats = worker_stats(frozen_worker.address)
        if stats.kv_blocks_free == baseline.kv_blocks_free and stats.running == 0:
            break
        assert time.monotonic() < deadline, f"KV not freed: {stats} (baseline {baseline})"
        time.sleep(0.05)
