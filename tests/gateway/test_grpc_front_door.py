"""splitserve.v1.Gateway/Generate: the HTTP API's semantics for internal gRPC callers."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from fake_workers import FakeDecode, delta, exhausted, fails_after, hangs
from gateway_processes import admin_url, openai_client
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.metrics_text import scrape


def _generate(address: str, **fields) -> list[gateway_pb2.GenerateTextResponse]:
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return list(stub.Generate(gateway_pb2.GenerateTextRequest(**fields), timeout=60))


def _greedy(max_tokens: int, **extra) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, has_temperature=True,
                                     **extra)


def test_text_prompt_streams_text_and_tokens_like_http(stack, tiny_llama_dir):
    responses = _generate(stack.grpc_address, text="The old library",
                          sampling=_greedy(10, logprobs=1))
    http = openai_client(stack.url).completions.create(
        model=tiny_llama_dir.name, prompt="The old library", max_tokens=10, temperature=0)
    assert "".join(r.text for r in responses) == http.choices[0].text
    assert sum(len(r.token_ids) for r in responses) == 10
    assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == 10 and last.usage.prompt_tokens == http.usage.prompt_tokens
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])


def test_token_id_prompt_with_a_stop_string(disagg_stack):
    full = _generate(disagg_stack.grpc_address, token_ids=gateway_pb2.TokenIds(ids=[42, 71, 265]),
                     sampling=_greedy(30, ignore_eos=True))
    text = "".join(r.text for r in full)
    stop = text[10:13]
    stopped = _generate(disagg_stack.grpc_address,
                        token_ids=gateway_pb2.TokenIds(ids=[42, 71, 265]),
                        sampling=_greedy(30, ignore_eos=True), stop=[stop])
    assert "".join(r.text for r in stopped) == text[: text.index(stop)]
    assert stopped[-1].finish_reason == common_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(("fields", "code"), [
    ({"text": "hi", "model": "nope"}, grpc.StatusCode.NOT_FOUND),
    ({}, grpc.StatusCode.INVALID_ARGUMENT),  # no prompt
    ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"text": "hi", "sampling": common_pb2.SamplingParams(top_p=3.0)}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"token_ids": gateway_pb2.TokenIds(ids=[10**6])}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"text": "hi", "sampling": common_pb2.SamplingParams(max_tokens=100000)}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"text": "hi", "request_id": "r" * 129}, grpc.StatusCode.INVALID_ARGUMENT),  # over 128
    # as HTTP refuses it (it was taken as off)
    ({"text": "hi", "sampling": common_pb2.SamplingParams(top_k=-5)}, grpc.StatusCode.INVALID_ARGUMENT),
    # larger than gRPC's default 4 MiB message: judged as a prompt (too long), not refused as
    # RESOURCE_EXHAUSTED, which the API keeps for "overloaded, retry later"
    ({"text": "word " * (1 << 20)}, grpc.StatusCode.INVALID_ARGUMENT),
    # over --max-body-bytes (8 MiB), as HTTP's 413: grpc-core's own size refusal was
    # RESOURCE_EXHAUSTED (a gRPC audit)
    ({"token_ids": gateway_pb2.TokenIds(ids=[1] * 9_000_000)}, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_invalid_requests_get_status_codes(disagg_stack, fields, code):
    with pytest.raises(grpc.RpcError) as caught:
        _generate(disagg_stack.grpc_address, **fields)
    assert caught.value.code() == code


def test_a_failure_after_output_is_a_final_error_message_not_a_retryable_status(
        servers, gateway_factory):
    """UNAVAILABLE would invite a standard retry policy to replay text already delivered:
    the call ends OK after a last message with FINISH_REASON_ERROR and the error, as an SSE
    stream ends with its error event. Before that the stream migrates, as over HTTP: each
    move resumes from the tokens delivered, up to --migration-limit (3) moves."""
    worker = servers(FakeDecode(fails_after([40, 41, 42], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address)
    responses = _generate(gateway.field("grpc"), text="hi", sampling=_greedy(10))
    assert [t for r in responses for t in r.token_ids] == [40, 41, 42]  # delivered once
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ERROR
    assert "UNAVAILABLE" in last.error and last.usage.completion_tokens == 3
    calls = worker.servicer.calls
    assert len(calls) == 4  # the first attempt and three moves, never a restart from scratch
    assert all(list(c.resumed_output_token_ids) == [40, 41, 42] for c in calls[1:])


def test_streams_still_open_at_the_end_of_a_drain_end_as_failures_do(servers, gateway_factory,
                                                                     tiny_llama_dir):
    """SIGTERM, with streams that will not finish within the grace (their worker hangs after
    two tokens): a second before the grace runs out each ends as a failure after output does,
    a last message with FINISH_REASON_ERROR and status OK over gRPC, an error event and [DONE]
    over SSE. Left to the servers' stop, the gRPC call ended UNAVAILABLE "Cancelling all
    calls" (a status retry policies replay, delivered text and all)."""
    worker = servers(FakeDecode(hangs([40, 41], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address, "--shutdown-grace-s", "3")
    started = [threading.Event(), threading.Event()]
    ended: dict[str, float] = {}

    def over_grpc():
        with grpc.insecure_channel(gateway.field("grpc")) as channel:
            call = gateway_pb2_grpc.GatewayStub(channel).Generate(
                gateway_pb2.GenerateTextRequest(text="hi", sampling=_greedy(100)), timeout=60)
            responses = []
            for response in call:
                responses.append(response)
                started[0].set()
            ended["grpc"] = time.monotonic()
            return call.code(), responses

    def over_sse():
        body = {"model": tiny_llama_dir.name, "prompt": "hi", "max_tokens": 100, "stream": True}
        with httpx.stream("POST", f"http://{gateway.address}/v1/completions", json=body,
                          timeout=60) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                started[1].set()
            ended["sse"] = time.monotonic()
            return response.status_code, lines

    with ThreadPoolExecutor(2) as pool:
        grpc_call, sse_call = pool.submit(over_grpc), pool.submit(over_sse)
        assert all(event.wait(30) for event in started)
        time.sleep(0.3)
        stopped = time.monotonic()
        gateway.process.send_signal(signal.SIGTERM)
        code, responses = grpc_call.result(30)
        status, lines = sse_call.result(30)
    assert code == grpc.StatusCode.OK
    assert [t for r in responses for t in r.token_ids] == [40, 41]
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert "shutting down" in responses[-1].error
    assert status == 200 and [line for line in lines if line][-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-2]["choices"][0]["finish_reason"] == "error"
    errors = [event["error"] for event in events if "error" in event]
    assert [e["code"] for e in errors] == ["server_shutting_down"]
    for name, at in ended.items():  # at the cutoff: the 3 s grace less its 1 s margin
        assert 1.5 < at - stopped < 2.9, (name, at - stopped)
    assert gateway.process.wait(30) == 0, gateway.output()


def test_a_failure_before_output_keeps_its_status_code(servers, gateway_factory):
    worker = servers(FakeDecode(exhausted(), role="both"))
    gateway = gateway_factory("--worker", worker.address)
    with pytest.raises(grpc.RpcError) as caught:
        _generate(gateway.field("grpc"), text="hi", sampling=_greedy(10))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # overloaded: retry later
    # ... and when, as HTTP's Retry-After says
    assert ("retry-after", "1") in (caught.value.trailing_metadata() or ())


def test_a_deadline_that_passes_mid_stream_ends_deadline_exceeded(servers, gateway_factory):
    """The gateway's deadline is the caller's own, so two timers race: the call once ended OK
    now and then, after a last message with FINISH_REASON_ERROR. Whichever fires first, the
    status is DEADLINE_EXCEEDED. The call's id comes back as x-request-id."""
    worker = servers(FakeDecode(hangs([40, 41], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address)
    codes = []
    with grpc.insecure_channel(gateway.field("grpc")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for timeout in (0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65):
            call = stub.Generate(gateway_pb2.GenerateTextRequest(
                text="hi", sampling=_greedy(10), request_id=f"mine-{timeout}"), timeout=timeout)
            try:
                for _ in call:
                    pass
                codes.append(call.code())
            except grpc.RpcError as error:
                codes.append(error.code())
            assert dict(call.initial_metadata())["x-request-id"].startswith(f"mine-{timeout}")
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes


def _paced(request, context, fake):
    """A decode script: a token every 10 ms, for longer than any deadline below (4 s)."""
    for i in range(400):
        yield delta([40 + i % 50], i)
        time.sleep(0.01)


def test_a_callers_deadline_passing_mid_stream_counts_as_a_timeout(servers, gateway_factory):
    """While tokens flow, the caller's cancellation at its deadline reaches the gateway a few
    ms before the gateway's own clock (reckoned from arrival) gets there: 8 of 9 such calls
    were counted as client disconnects in an audit. Each counts as a timeout."""
    worker = servers(FakeDecode(_paced, role="both"))
    gateway = gateway_factory("--worker", worker.address)
    timeouts = (0.6, 0.7, 0.8, 0.9, 1.0, 1.1)
    with grpc.insecure_channel(gateway.field("grpc")) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for timeout in timeouts:
            with pytest.raises(grpc.RpcError) as caught:
                for _ in stub.Generate(gateway_pb2.GenerateTextRequest(
                        text="hi", sampling=_greedy(400)), timeout=timeout):
                    pass
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    def outcomes() -> dict[str, float]:
        return {name.split('reason="')[1].split('"')[0]: value
                for name, value in scrape(admin_url(f"http://{gateway.address}")).items()
                if name.startswith("splitserve_gateway_requests_total{") and value}

    for _ in range(50):
        if sum(outcomes().values()) >= len(timeouts):
            break
        time.sleep(0.1)
    assert outcomes() == {"request_timeout": len(timeouts)}


def test_request_bytes_that_do_not_parse_are_invalid_argument(disagg_stack):
    """Field 3 (text) holding bytes that are not UTF-8: INVALID_ARGUMENT naming the defect,
    as the workers answer, not UNKNOWN."""
    with grpc.insecure_channel(disagg_stack.grpc_address) as channel:
        raw = channel.unary_stream("/splitserve.v1.Gateway/Generate")
        with pytest.raises(grpc.RpcError) as caught:
            list(raw(b"\x1a\x02\xff\xfe", timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse" in caught.value.details()


def test_prompt_logprobs_and_stop_reason_as_the_http_api_gives_them(stack, engine):
    """sampling.prompt_logprobs: on the first message, each prompt token after the first with
    its logprob, rank and the k likeliest in its place, equal to the engine's own; the message
    that stops on a stop string or a stop token id says which (vLLM's stop_reason)."""
    from engine.sampling_params import SamplingParams

    [expected] = engine.generate(["The old library"], SamplingParams(
        temperature=0.0, max_tokens=1, prompt_logprobs=2))
    responses = _generate(stack.grpc_address, text="The old library",
                          sampling=_greedy(4, prompt_logprobs=2))
    got = responses[0].prompt_logprobs
    assert [p.token_id for p in got] == list(expected.prompt_token_ids[1:])
    for entry, want in zip(got, expected.prompt_logprobs[1:], strict=True):
        assert entry.rank == want.rank and entry.logprob == pytest.approx(want.logprob, abs=1e-3)
        assert {t.token_id: pytest.approx(t.logprob, abs=1e-3) for t in entry.top} == want.top
    assert not any(r.prompt_logprobs for r in responses[1:])
    assert not _generate(stack.grpc_address, text="The old library",
                         sampling=_greedy(2))[0].prompt_logprobs

    full = _generate(stack.grpc_address, text="The old library",
                     sampling=_greedy(12, ignore_eos=True))
    text, tokens = "".join(r.text for r in full), [t for r in full for t in r.token_ids]
    assert full[-1].WhichOneof("stop_reason") is None  # ended at max_tokens
    by_string = _generate(stack.grpc_address, text="The old library",
                          sampling=_greedy(12, ignore_eos=True), stop=[text[6:9]])
    assert by_string[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert by_string[-1].stop_string == text[6:9]
    stop_token = next(t for k, t in enumerate(tokens) if k and t not in tokens[:k])
    by_token = _generate(stack.grpc_address, text="The old library",
                         sampling=_greedy(12, ignore_eos=True, stop_token_ids=[stop_token]))
    assert by_token[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert by_token[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert by_token[-1].stop_token_id == stop_token


def test_the_standard_health_service_answers_beside_the_front_door(disagg_stack):
    """grpc.health.v1.Health, for gRPC load-balancer checks and Kubernetes `grpc` probes:
    SERVING while the gateway has workers to route to (as /ready)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(disagg_stack.grpc_address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "splitserve.v1.Gateway"):
            answer = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as caught:
            stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
