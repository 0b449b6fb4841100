"""Failure semantics seen by HTTP clients, with a real gateway process in front of scripted
workers: invisible retry before the first token, an explicit error after it, 503 with
Retry-After when every worker is full or gone, 401 and 429 from admission."""

from __future__ import annotations

import itertools
import json
import time

import httpx
import openai
import pytest
from fake_workers import FakeDecode, fails_after, hangs, streams
from gateway_processes import openai_client
from splitserve.v1 import common_pb2


@pytest.fixture
def model(tiny_llama_dir) -> str:
    return tiny_llama_dir.name


def _sse_events(response: httpx.Response) -> list:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


def test_failure_after_tokens_ends_the_stream_with_an_error(servers, gateway_factory, model):
    # Migration off: the break after tokens is the end (test_dispatcher.py and
    # test_request_migration.py cover the move to another worker).
    worker = servers(FakeDecode(fails_after([40, 41, 42], start_index=0), role="both"))
    gateway = gateway_factory("--worker", worker.address, "--migration-limit", "0")
    url = f"http://{gateway.address}"
    with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
            "model": model, "prompt": "hi", "max_tokens": 10, "stream": True}) as response:
        assert response.status_code == 200
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "UNAVAILABLE" in error["message"]
    assert worker.address not in error["message"]  # the cluster's addresses are not the caller's
    last_chunk = json.loads(events[-3])
    assert last_chunk["choices"][0]["finish_reason"] == "error"
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert "".join(texts)  # the tokens before the failure were delivered, once
    assert len(worker.servicer.calls) == 1  # never silently restarted
    # The SDK hands over the chunks, then raises on the error event.
    seen = []
    with pytest.raises(openai.APIError, match="UNAVAILABLE"):
        for chunk in openai_client(url).completions.create(model=model, prompt="hi",
                                                           max_tokens=10, stream=True):
            seen.append(chunk.choices[0].finish_reason)
    assert seen[-1] == "error"
    # Not streaming: nothing was sent yet, so it is a plain 500 error body.
    whole = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hi"}, timeout=30)
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "worker_failed"


def test_a_whole_answer_with_no_worker_left_to_move_to_is_a_503(servers, gateway_factory,
                                                                model):
    """Not streamed, nothing was sent: a stream whose worker failed and that found no worker
    to move to is a 503 with Retry-After, as before its first token (it was a 500 whose
    message said 503; a migration audit), and no message names a worker's address."""
    crash = fails_after([40, 41, 42], start_index=0)

    def script(request, context, fake):
        fake.health = common_pb2.HealthResponse(  # gone from rotation once it has failed
            **{**{f.name: getattr(fake.health, f.name) for f, _ in fake.health.ListFields()},
               "status": common_pb2.HealthResponse.DRAINING})
        yield from crash(request, context, fake)

    worker = servers(FakeDecode(script, role="both"))
    gateway = gateway_factory("--worker", worker.address, "--migration-wait-s", "1")
    whole = httpx.post(f"http://{gateway.address}/v1/completions", timeout=30,
                       json={"model": model, "prompt": "hi", "max_tokens": 10})
    assert whole.status_code == 503 and whole.headers["retry-after"], whole.text
    assert whole.json()["error"]["code"] == "overloaded"
    assert worker.address not in whole.text and "no worker to migrate to" in whole.text


def test_one_choice_failing_ends_every_open_choice_and_counts_their_tokens(servers,
                                                                          gateway_factory,
                                                                          model):
    """n=2, migration off: one choice's worker fails after 3 tokens while the other has sent 4
    and goes on. The response ends with the error event; before it, the open choice gets its
    finishing chunk too (a migration audit saw an n=2 stream leave one choice without a
    finish_reason), and the usage counts both choices' tokens (it counted the failed one's)."""
    calls = itertools.count()
    fail, go_on = fails_after([40, 41, 42], start_index=0), hangs([50, 51, 52, 53], start_index=0)

    def script(request, context, fake):
        if next(calls) == 0:
            yield from fail(request, context, fake)
        else:
            time.sleep(0.01)
            yield from go_on(request, context, fake)

    worker = servers(FakeDecode(script, role="both"))
    gateway = gateway_factory("--worker", worker.address, "--migration-limit", "0")
    with httpx.stream("POST", f"http://{gateway.address}/v1/completions", timeout=30, json={
            "model": model, "prompt": "hi", "max_tokens": 10, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c for c in chunks if "error" in c], chunks
    finished = {c["index"]: c["finish_reason"] for chunk in chunks
                for c in chunk.get("choices", ()) if c["finish_reason"]}
    assert finished == {0: "error", 1: "error"}, chunks
    (usage,) = [chunk["usage"] for chunk in chunks if chunk.get("usage")]
    assert usage["completion_tokens"] == 7, usage


def test_failure_before_the_first_token_is_retried_invisibly(servers, gateway_factory, model):
    def fails_first_time(request, context, fake):
        if len(fake.calls) == 1:
            yield from fails_after([])(request, context, fake)
        else:
            yield from streams([40, 41], start_index=0)(request, context, fake)

    worker = servers(FakeDecode(fails_first_time, role="both"))
    gateway = gateway_factory("--worker", worker.address)
    response = openai_client(f"http://{gateway.address}").completions.create(
        model=model, prompt="hi", max_tokens=2, stream=True)
    chunks = list(response)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(worker.servicer.calls) == 2


def test_all_workers_full_or_gone_is_503_with_retry_after(servers, gateway_factory, model):
    from fake_workers import exhausted

    worker = servers(FakeDecode(exhausted(), role="both"))
    gateway = gateway_factory("--worker", worker.address)
    for stream in (False, True):
        response = httpx.post(f"http://{gateway.address}/v1/chat/completions", timeout=30, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream})
        assert response.status_code == 503, response.text
        assert response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "server_error"
    worker.stop()
    # Workers gone: not ready, and requests get 503 too.
    import time

    deadline = time.monotonic() + 10
    while httpx.get(f"http://{gateway.admin_address}/ready", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, "gateway still claims to be ready"
        time.sleep(0.05)
    response = httpx.post(f"http://{gateway.address}/v1/completions", timeout=30,
                          json={"model": model, "prompt": "hi"})
    assert response.status_code == 503 and "retry-after" in response.headers


def test_api_keys_and_per_key_inflight_limit(servers, gateway_factory, model):
    def by_max_tokens(request, context, fake):
        if request.sampling.max_tokens == 99:  # the request that stays in flight
            yield from hangs(after_tokens=[40], start_index=0)(request, context, fake)
        else:
            yield from streams([40], start_index=0)(request, context, fake)

    worker = servers(FakeDecode(by_max_tokens, role="both"))
    gateway = gateway_factory("--worker", worker.address, "--api-keys", "key-a,key-b",
                              "--max-inflight-per-key", "1")
    url = f"http://{gateway.address}/v1/completions"
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    bad = httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    with openai_client(f"http://{gateway.address}", api_key="key-a").completions.create(
            model=model, prompt="hi", max_tokens=99, stream=True) as held:
        next(iter(held))  # key-a now has one request in flight
        limited = httpx.post(url, json=body, headers={"Authorization": "Bearer key-a"}, timeout=30)
        assert limited.status_code == 429 and limited.headers["retry-after"]
        assert limited.json()["error"]["type"] == "rate_limit_error"
        other = httpx.post(url, json=body, headers={"Authorization": "Bearer key-b"}, timeout=30)
        assert other.status_code == 200
    assert worker.servicer.cancelled.wait(5)  # closing the held stream cancelled it
    again = httpx.post(url, json=body, headers={"Authorization": "Bearer key-a"}, timeout=30)
    assert again.status_code == 200
