"""The gateway's edge limits: every over-limit input is a 400 with OpenAI's error body
(INVALID_ARGUMENT over gRPC) that names the parameter and never reaches a worker; inputs at a
limit are served; request ids up to the limit fit the workers' KV header."""

from __future__ import annotations

import math

import grpc
import httpx
import pytest
from gateway_processes import start_gateway, worker_stats
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from services.gateway.api.request_ids import gateway_request_id, worker_request_id
from services.gateway.config import GatewayConfig

LIMIT_FLAGS = ("--max-prompts-per-request", "4", "--max-choices-per-request", "6",
               "--max-stop-strings", "2", "--max-stop-string-chars", "8",
               "--max-stop-token-ids", "3", "--max-request-id-length", "16")


@pytest.fixture(scope="module")
def limited(tiny_llama_dir, disagg_workers):
    """A gateway with small limits in front of the shared disaggregated workers."""
    prefill, decode = disagg_workers
    gateway = start_gateway(tiny_llama_dir, "--prefill", prefill.address, "--decode",
                            decode.address, *LIMIT_FLAGS)
    yield gateway, (prefill, decode)
    gateway.stop()


def _steps(workers) -> list[int]:
    return [worker_stats(w.address, w.name).steps for w in workers]


def test_each_limit_is_a_400_naming_its_parameter_and_no_worker_sees_it(limited, tiny_llama_dir):
    gateway, workers = limited
    model = tiny_llama_dir.name
    hi = [{"role": "user", "content": "hi"}]
    comp, chat = "/v1/completions", "/v1/chat/completions"
    cases = [
        # The last prompt is outside the vocabulary: the count is refused before any prompt is
        # looked at, so the error is about the count, not the token.
        ("5 prompts", comp, {"prompt": [[1], [2], [3], [4], [10**8]]}, {}, "prompt"),
        ("4 prompts x n=2", comp, {"prompt": ["a", "b", "c", "d"], "n": 2}, {}, "n"),
        ("chat n over MAX_N", chat, {"messages": hi, "n": 129}, {}, "n"),
        ("3 stop strings", comp, {"prompt": "hi", "stop": ["a", "b", "c"]}, {}, "stop"),
        ("9-character stop", chat, {"messages": hi, "stop": "abcdefghi"}, {}, "stop"),
        ("4 stop_token_ids", comp, {"prompt": "hi", "stop_token_ids": [1, 2, 3, 4]}, {},
         "stop_token_ids"),
        ("chat 4 stop_token_ids", chat, {"messages": hi, "stop_token_ids": [1, 2, 3, 4]}, {},
         "stop_token_ids"),
        ("17-character request id", comp, {"prompt": "hi"}, {"x-request-id": "r" * 17},
         "x-request-id"),
        ("non-ASCII request id", comp, {"prompt": "hi"}, {"x-request-id": b"caf\xc3\xa9"},
         "x-request-id"),
    ]
    before = _steps(workers)
    failures = []
    with httpx.Client(base_url=f"http://{gateway.address}", timeout=30) as client:
        for name, path, body, headers, param in cases:
            response = client.post(path, json={"model": model, "max_tokens": 2, **body},
                                   headers=headers)
            error = response.json().get("error", {})
            if not (response.status_code == 400 and error.get("param") == param
                    and {"message", "type", "param", "code"} <= error.keys()
                    and error["type"] == "invalid_request_error"):
                failures.append(f"{name}: {response.status_code} {response.text[:300]}")
            elif param != "n" and "request id" not in name and error["code"] not in (
                    "array_above_max_length", "string_above_max_length"):
                failures.append(f"{name}: code {error['code']}")
    assert not failures, "\n".join(failures)
    assert _steps(workers) == before, "an over-limit request reached a worker"


def test_requests_at_each_limit_are_served(limited, tiny_llama_dir):
    gateway, _ = limited
    response = httpx.post(f"http://{gateway.address}/v1/completions", timeout=60, headers={
        "x-request-id": "r" * 16}, json={
        "model": tiny_llama_dir.name, "prompt": ["a", "b", "c"], "n": 2, "max_tokens": 2,
        "stop": ["zzzzzzzz", "y"], "stop_token_ids": [1, 2, 3]})
    assert response.status_code == 200, response.text
    assert sorted(c["index"] for c in response.json()["choices"]) == list(range(6))
    assert response.headers["x-request-id"].startswith("r" * 16)


@pytest.mark.parametrize(("fields", "what"), [
    ({"request_id": "g" * 17}, "request id"),
    ({"stop": ["a", "b", "c"]}, "stop"),
    ({"sampling": common_pb2.SamplingParams(max_tokens=2, stop_token_ids=[1, 2, 3, 4])},
     "stop_token_ids"),
])
def test_grpc_over_a_limit_is_invalid_argument(limited, fields, what):
    gateway, _ = limited
    with grpc.insecure_channel(gateway.field("grpc")) as channel, \
            pytest.raises(grpc.RpcError) as caught:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateTextRequest(text="hi", **fields), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert what in caught.value.details()


def test_a_request_id_at_the_default_limit_is_served_end_to_end(disagg_stack, tiny_llama_dir):
    """128 characters: far past the KV header's 64-byte key, so only the bounded worker id
    lets the KV transfer go through (else decode would wait out its KV timeout)."""
    supplied = "x" * 128
    response = httpx.post(f"{disagg_stack.url}/v1/completions", timeout=30,
                          headers={"x-request-id": supplied}, json={
                              "model": tiny_llama_dir.name, "prompt": "hello there",
                              "max_tokens": 4, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert response.headers["x-request-id"].startswith(supplied)


def test_worker_request_ids_fit_the_kv_header_with_every_suffix():
    from kv_transfer import MAX_KEY_BYTES
    from services.gateway.api.request_limits import MAX_CHOICES_CEILING

    ids = set()
    for supplied in ("a" * 128, "a" * 127 + "b", "short", None):
        worker_id = worker_request_id(gateway_request_id(supplied, 128, "x-request-id"))
        longest = f"{worker_id}-{MAX_CHOICES_CEILING - 1}-retry1"
        assert len(longest.encode()) <= MAX_KEY_BYTES, longest
        ids.add(worker_id)
    assert len(ids) == 4  # ids that share a long head still differ
    assert worker_request_id("short-1234") == "short-1234"  # short ids travel verbatim


@pytest.mark.parametrize(("field", "value"), [
    ("max_prompts_per_request", 0), ("max_choices_per_request", 20_000),
    ("max_stop_token_ids", 0), ("max_request_id_length", 0), ("tokenizer_threads", 0),
    ("request_timeout_s", -1.0), ("stall_timeout_s", math.nan),
    ("request_timeout_s", math.inf)])
def test_bad_limit_settings_are_refused_with_the_flag_named(tiny_llama_dir, field, value):
    with pytest.raises(ValueError, match=field.replace("_", "-")):
        GatewayConfig(model=str(tiny_llama_dir), worker=("a:1",), **{field: value})


def test_limits_and_timeouts_are_printed_at_start_up(tiny_llama_dir):
    described = GatewayConfig(model=str(tiny_llama_dir), worker=("a:1",)).describe()
    for text in ("max_prompts_per_request=1024", "max_choices_per_request=1024",
                 "max_stop_token_ids=256", "max_request_id_length=128", "tokenizer_threads=2",
                 "request_timeout_s=600.0", "stall_timeout_s=90.0"):
        assert text in described
