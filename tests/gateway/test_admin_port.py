"""The public port serves the API and /health only; /metrics, /ready (which lists worker
addresses) and /openapi.json are on the admin port, 127.0.0.1 unless told otherwise. Real
gateway processes over real workers (the tiny model)."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from services.gateway.config import GatewayConfig


@pytest.mark.parametrize("path", ["/metrics", "/ready", "/openapi.json", "/docs"])
def test_the_public_port_does_not_describe_the_cluster(disagg_stack, path):
    response = httpx.get(disagg_stack.url + path, timeout=10)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert disagg_stack.decode.address not in response.text


def test_the_admin_port_serves_metrics_readiness_and_the_api_document(disagg_stack):
    assert disagg_stack.gateway.admin_address.startswith("127.0.0.1:")
    assert disagg_stack.gateway.admin_address != disagg_stack.gateway.address
    admin = disagg_stack.admin_url
    ready = httpx.get(f"{admin}/ready", timeout=10)
    assert ready.status_code == 200
    assert disagg_stack.decode.address in {w["address"] for w in ready.json()["workers"]}
    metrics = httpx.get(f"{admin}/metrics", timeout=10)
    assert metrics.status_code == 200 and "splitserve_gateway_requests_total" in metrics.text
    assert httpx.get(f"{admin}/health", timeout=10).json() == {"status": "ok"}
    paths = httpx.get(f"{admin}/openapi.json", timeout=10).json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/health"} <= set(paths)
    assert "/metrics" not in paths and "/ready" not in paths
    # The admin port is no second front door.
    assert httpx.post(f"{admin}/v1/completions", json={}, timeout=10).status_code == 404


def test_ready_self_says_the_gateway_takes_requests_with_no_worker_to_route_to(
        gateway_factory, tiny_llama_dir):
    """/ready/self (the chart's readiness probe) is 200 while the gateway takes requests, so a
    worker outage leaves the gateways in their Service answering 503 overloaded + Retry-After
    themselves; /ready says whether a request can be routed."""
    gateway = gateway_factory("--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1")
    admin = f"http://{gateway.admin_address}"
    assert httpx.get(f"{admin}/ready", timeout=10).status_code == 503
    ready = httpx.get(f"{admin}/ready/self", timeout=10)
    assert ready.status_code == 200 and ready.json()["routable"] is False
    answer = httpx.post(f"http://{gateway.address}/v1/completions", timeout=30, json={
        "model": tiny_llama_dir.name, "prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 503 and answer.headers["retry-after"]
    assert answer.json()["error"]["code"] == "overloaded"


def test_ready_self_is_503_while_the_gateway_drains(disagg_workers, gateway_factory):
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--shutdown-grace-s", "6")
    admin = f"http://{gateway.admin_address}"
    assert httpx.get(f"{admin}/ready/self", timeout=10).status_code == 200
    gateway.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    status = 200
    while status == 200 and time.monotonic() < deadline:
        status = httpx.get(f"{admin}/ready/self", timeout=5).status_code
        time.sleep(0.05)
    assert status == 503


def test_the_admin_port_can_be_turned_off(gateway_factory, disagg_workers):
    prefill, decode = disagg_workers
    gateway = gateway_factory("--prefill", prefill.address, "--decode", decode.address,
                              "--admin-port", "-1")
    assert gateway.admin_address == ""
    assert httpx.get(f"http://{gateway.address}/metrics", timeout=10).status_code == 404
    assert httpx.get(f"http://{gateway.address}/health", timeout=10).status_code == 200


def test_the_admin_port_defaults_to_the_next_port_or_a_free_one(tiny_llama_dir):
    def config(**kwargs) -> GatewayConfig:
        return GatewayConfig(model=str(tiny_llama_dir), worker=("127.0.0.1:1",), **kwargs)

    assert config().admin_listen_port == 8001 and config().admin_host == "127.0.0.1"
    assert config(port=0).admin_listen_port == 0  # any free port, as the public one
    assert config(port=9000, admin_port=9500).admin_listen_port == 9500
    assert config(admin_port=-1).admin_listen_port == -1


def test_the_admin_port_cannot_be_the_public_port(tiny_llama_dir):
    with pytest.raises(ValueError, match="--admin-port must differ from --port"):
        GatewayConfig(model=str(tiny_llama_dir), worker=("127.0.0.1:1",), port=8123,
                      admin_port=8123)
    with pytest.raises(ValueError, match="--admin-port"):
        GatewayConfig(model=str(tiny_llama_dir), worker=("127.0.0.1:1",), admin_port=-2)
