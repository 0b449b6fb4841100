"""Malformed requests get 4xx with OpenAI's error body, never a 5xx; they never reach a worker
and do not disturb the requests that follow."""

from __future__ import annotations

import httpx
import pytest
from gateway_processes import worker_stats

LONG_PROMPT = "Our team builds two paper boats near the station. " * 80  # > 512 tokens


def _cases(model: str) -> list[tuple[str, str, object, int, str | None]]:
    """(name, path, body, expected status, expected param); bytes bodies go out verbatim."""
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    hi = [{"role": "user", "content": "hi"}]
    return [
        ("bad json", chat, b'{"model": "x", "messages": [', 400, None),
        ("json array body", comp, b"[1, 2, 3]", 400, None),
        ("model is a number", comp, {"model": 7, "prompt": "hi"}, 400, "model"),
        ("missing prompt", comp, {"model": model}, 400, "prompt"),
        ("max_tokens is a string", comp, {"model": model, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
        ("negative max_tokens", comp, {"model": model, "prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
        ("zero max_tokens", chat, {"model": model, "messages": hi, "max_tokens": 0}, 400, "max_tokens"),
        ("unknown model", chat, {"model": "gpt-17", "messages": hi}, 404, "model"),
        ("empty messages", chat, {"model": model, "messages": []}, 400, "messages"),
        ("messages not a list", chat, {"model": model, "messages": "hi"}, 400, "messages"),
        ("unknown role", chat, {"model": model, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ("image content part", chat, {"model": model, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content.0.type"),
        ("image part in a Responses input", "/v1/responses", {"model": model, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input.0.content.0.type"),
        ("prompt too long", comp, {"model": model, "prompt": LONG_PROMPT}, 400, "prompt"),
        ("prompt + max_tokens over context", comp, {"model": model, "prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ("prompt + max_completion_tokens over context", chat, {"model": model, "messages": hi, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
        ("stream_options without stream", chat, {"model": model, "messages": hi, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("negative temperature", comp, {"model": model, "prompt": "hi", "temperature": -1}, 400, "temperature"),
        ("temperature above two", chat, {"model": model, "messages": hi, "temperature": 100}, 400, "temperature"),
        ("empty stop string", comp, {"model": model, "prompt": "hi", "stop": ["x", ""]}, 400, "stop"),
        ("top_p above one", comp, {"model": model, "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
        ("presence_penalty out of range", chat, {"model": model, "messages": hi, "presence_penalty": 7}, 400, "presence_penalty"),
        ("logprobs too many", comp, {"model": model, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
        ("top_logprobs without logprobs", chat, {"model": model, "messages": hi, "top_logprobs": 2}, 400, "top_logprobs"),
        ("n zero", comp, {"model": model, "prompt": "hi", "n": 0}, 400, "n"),
        ("stop is a number", comp, {"model": model, "prompt": "hi", "stop": 7}, 400, "stop"),
        ("token id outside vocabulary", comp, {"model": model, "prompt": [1, 2, 99999999]}, 400, "prompt"),
        ("empty prompt", comp, {"model": model, "prompt": ""}, 400, "prompt"),
        ("empty prompt list", comp, {"model": model, "prompt": []}, 400, "prompt"),
        ("stream is a string", chat, {"model": model, "messages": hi, "stream": "yes"}, 400, "stream"),
        ("oversized body", comp, {"model": model, "prompt": "x" * (9 << 20)}, 413, None),
        # The edge limits at their defaults (services/gateway/api/request_limits.py).
        ("1025 prompts", comp, {"model": model, "prompt": ["hi"] * 1025}, 400, "prompt"),
        ("200 prompts x n=8", comp, {"model": model, "prompt": ["hi"] * 200, "n": 8}, 400, "n"),
        ("17 stop strings", chat, {"model": model, "messages": hi, "stop": list("abcdefghijklmnopq")}, 400, "stop"),
        ("257-character stop", comp, {"model": model, "prompt": "hi", "stop": "s" * 257}, 400, "stop"),
        ("stop token id outside vocabulary", comp, {"model": model, "prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
        ("257 stop_token_ids", comp, {"model": model, "prompt": "hi", "stop_token_ids": list(range(1, 258))}, 400, "stop_token_ids"),
    ]


def test_malformed_requests_get_openai_errors_and_never_reach_a_worker(disagg_stack, tiny_llama_dir):
    model = tiny_llama_dir.name
    cases = _cases(model)
    assert len(cases) >= 12
    before = {w.name: worker_stats(w.address, w.name).steps for w in (disagg_stack.prefill, disagg_stack.decode)}
    failures = []
    with httpx.Client(base_url=disagg_stack.url, timeout=30) as client:
        for name, path, body, status, param in cases:
            if isinstance(body, bytes):
                response = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = client.post(path, json=body)
            error = response.json().get("error") if response.headers.get("content-type", "").startswith("application/json") else None
            ok = (response.status_code == status and isinstance(error, dict)
                  and {"message", "type", "param", "code"} <= error.keys() and error["message"]
                  and (param is None or error["param"] == param))
            if not ok:
                failures.append(f"{name}: {response.status_code} {response.text[:200]}")
    assert not failures, "\n".join(failures)
    after = {w.name: worker_stats(w.address, w.name).steps for w in (disagg_stack.prefill, disagg_stack.decode)}
    assert after == before, "a malformed request reached a worker"
    assert disagg_stack.gateway.alive()
    good = httpx.post(f"{disagg_stack.url}/v1/completions", json={
        "model": model, "prompt": "hi", "max_tokens": 3}, timeout=30)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)])
def test_unknown_paths_and_methods_get_openai_error_bodies(disagg_stack, method, path, status):
    response = httpx.request(method, f"{disagg_stack.url}{path}", timeout=10)
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_chunked_body_over_the_limit_is_413(gateway_factory, disagg_workers):
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--max-body-bytes", "64KiB")

    def body():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"x" * 8192
        yield b'"}'

    response = httpx.post(f"http://{gateway.address}/v1/completions", content=body(), timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize(("request_id", "status"), [("r" * 129, 400), (b"caf\xc3\xa9", 400),
                                                     ("r" * 128, 200)])
def test_request_ids_over_the_limit_are_refused_not_replaced(disagg_stack, tiny_llama_dir,
                                                            request_id, status):
    response = httpx.post(f"{disagg_stack.url}/v1/completions", timeout=30,
                          headers={"x-request-id": request_id},
                          json={"model": tiny_llama_dir.name, "prompt": "hi", "max_tokens": 2})
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["param"] == "x-request-id"
