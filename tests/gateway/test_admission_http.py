"""Tenants at the front doors of a real gateway: keys over `Authorization: Bearer` (HTTP) and
metadata (gRPC), 401 for a wrong key, 429 with Retry-After and OpenAI's body over quota, and
tenants that never see, cancel or pay for each other's requests."""

from __future__ import annotations

import threading

import grpc
import httpx
import pytest
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tenant_load import metric, tenants_file


@pytest.fixture
def tenant_gateway(gateway_factory, disagg_workers, tmp_path):
    prefill, decode = disagg_workers
    path = tenants_file(tmp_path, {
        "acme": {"weight": 2},
        "tiny": {"tokens_per_minute": 60, "burst_tokens": 60, "max_output_tokens": 8},
    })
    return gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                           "--tenants-file", path)


def _body(model: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": model, "prompt": [40, 41, 42, 43], "max_tokens": max_tokens,
            "ignore_eos": True, **extra}


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _grpc(gateway, metadata=(), api_key: str = "", max_tokens: int = 4):
    with grpc.insecure_channel(gateway.field("grpc")) as channel:
        return list(gateway_pb2_grpc.GatewayStub(channel).Generate(
            gateway_pb2.GenerateTextRequest(
                token_ids=gateway_pb2.TokenIds(ids=[40, 41, 42, 43]), api_key=api_key,
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
            metadata=metadata, timeout=60))


def test_a_wrong_or_missing_key_is_401_over_http_and_grpc(tenant_gateway, tiny_llama_dir):
    url = f"http://{tenant_gateway.address}/v1/completions"
    body = _body(tiny_llama_dir.name)
    for headers in ({}, _bearer("sk-nobody"), {"Authorization": "sk-acme"}):
        response = httpx.post(url, json=body, headers=headers, timeout=30)
        assert response.status_code == 401
        assert response.json()["error"] == {
            "message": response.json()["error"]["message"], "type": "authentication_error",
            "param": None, "code": "invalid_api_key"}
    assert httpx.post(url, json=body, headers=_bearer("sk-acme"), timeout=30).status_code == 200
    with pytest.raises(grpc.RpcError) as refused:
        _grpc(tenant_gateway, metadata=(("authorization", "Bearer sk-nobody"),))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Who is asking is settled before what is asked: a bad request id from a caller without
    # a key is UNAUTHENTICATED, not INVALID_ARGUMENT (a gRPC audit)
    with grpc.insecure_channel(tenant_gateway.field("grpc")) as channel, \
            pytest.raises(grpc.RpcError) as refused:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateTextRequest(
            text="hi", request_id="x" * 500), timeout=60))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    served = _grpc(tenant_gateway, metadata=(("authorization", "Bearer sk-acme"),))
    assert served[-1].usage.completion_tokens == 4


def test_over_quota_is_429_with_retry_after_over_http_and_grpc(tenant_gateway, tiny_llama_dir):
    url = f"http://{tenant_gateway.address}/v1/completions"
    # max_tokens is capped at the tenant's 8: 4 + 8 = 12 tokens reserved per request.
    first = httpx.post(url, json=_body(tiny_llama_dir.name, 100), headers=_bearer("sk-tiny"),
                       timeout=30)
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 8
    statuses = []
    for _ in range(8):
        response = httpx.post(url, json=_body(tiny_llama_dir.name, 8), headers=_bearer("sk-tiny"),
                              timeout=30)
        statuses.append(response.status_code)
        if response.status_code == 429:
            break
    assert statuses[-1] == 429, statuses
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert response.json()["error"]["code"] == "rate_limit_exceeded"
    with pytest.raises(grpc.RpcError) as refused:
        _grpc(tenant_gateway, api_key="sk-tiny", max_tokens=8)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(refused.value.trailing_metadata())
    # gRPC's own retry policies wait as told (gRFC A6's pushback), as HTTP clients do
    assert int(trailers["grpc-retry-pushback-ms"]) == 1000 * int(trailers["retry-after"]) > 0
    # A request over the tenant's whole bucket (70 prompt + 8 tokens of 60) never fits: over
    # HTTP x-should-retry false; over gRPC a negative pushback, so no retry policy replays it
    # (the code is RESOURCE_EXHAUSTED as for a passing refusal).
    with grpc.insecure_channel(tenant_gateway.field("grpc")) as channel, \
            pytest.raises(grpc.RpcError) as never:
        list(gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateTextRequest(
            token_ids=gateway_pb2.TokenIds(ids=[40] * 70), api_key="sk-tiny",
            sampling=common_pb2.SamplingParams(max_tokens=8)), timeout=60))
    assert never.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(never.value.trailing_metadata())
    assert trailers["x-should-retry"] == "false" and trailers["grpc-retry-pushback-ms"] == "-1"
    assert "retry-after" not in trailers
    # Another tenant is not billed for it.
    other = httpx.post(url, json=_body(tiny_llama_dir.name), headers=_bearer("sk-acme"), timeout=30)
    assert other.status_code == 200


def test_tenants_never_see_cancel_or_pay_for_each_others_requests(tenant_gateway, tiny_llama_dir):
    gateway_url = f"http://{tenant_gateway.address}"
    url = f"{gateway_url}/v1/completions"
    same_id = {"x-request-id": "shared-id"}
    acme_text: list[str] = []
    acme_streaming = threading.Event()

    def acme() -> None:
        with httpx.stream("POST", url, json=_body(tiny_llama_dir.name, 200, stream=True),
                          headers={**_bearer("sk-acme"), **same_id}, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                acme_streaming.set()
                acme_text.append(line)

    worker = threading.Thread(target=acme)
    worker.start()
    assert acme_streaming.wait(30)
    # The other tenant, same request id, starts and walks away: only its own request ends.
    with httpx.stream("POST", url, json=_body(tiny_llama_dir.name, 8, stream=True),
                      headers={**_bearer("sk-tiny"), **same_id}, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"].startswith("shared-id")
        next(response.iter_lines())
    worker.join(60)
    events = [line for line in acme_text if line.startswith("data: {")]
    assert [line for line in acme_text if line][-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-1].replace(" ", "")
    # Each tenant is billed for its own tokens only.
    acme_billed = metric(gateway_url, "splitserve_gateway_served_tokens_total",
                         'kind="output",tenant="acme"')
    tiny_billed = metric(gateway_url, "splitserve_gateway_served_tokens_total",
                         'kind="output",tenant="tiny"')
    assert acme_billed == 200 and tiny_billed <= 8
