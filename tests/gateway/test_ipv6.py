"""IPv6: an IPv6-only cluster gives pods addresses like fd00::12, so every process must listen
on an IPv6 literal and write the addresses it advertises (READY lines, the registry, KV
endpoints) in brackets. Real processes on the IPv6 loopback, KV over TCP (no shared memory)."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import httpx
import pytest
from gateway_processes import disaggregated_stack
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.addresses import host_port


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_host_port_brackets_ipv6_literals_only():
    assert host_port("fd00::12", 50051) == "[fd00::12]:50051"
    assert host_port("::", "80") == "[::]:80"
    assert host_port("[::1]", 1) == "[::1]:1"
    assert host_port("10.0.0.7", 50051) == "10.0.0.7:50051"
    assert host_port("decode-0.splitserve", 50051) == "decode-0.splitserve:50051"


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_a_disaggregated_stack_serves_on_the_ipv6_loopback(tiny_llama_dir):
    flags = ("--host", "::1", "--kv-shared-memory-mib", "0")
    with disaggregated_stack(tiny_llama_dir, worker_flags=flags,
                             gateway_flags=("--host", "::1")) as stack:
        for process in (stack.prefill, stack.decode, stack.gateway):
            assert process.address.startswith("[::1]:"), process.ready_line
        assert stack.decode.field("kv").startswith("[::1]:"), stack.decode.ready_line
        with urllib.request.urlopen(f"http://{stack.decode.field('metrics')}/ready",
                                    timeout=10) as ready:
            assert ready.status == 200

        response = httpx.post(f"{stack.url}/v1/completions", timeout=60, json={
            "model": tiny_llama_dir.name, "prompt": "hello there", "max_tokens": 4,
            "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4

        # The prompt's KV crossed the IPv6 TCP channel to the decode worker.
        with urllib.request.urlopen(f"http://{stack.decode.field('metrics')}/metrics",
                                    timeout=10) as metrics:
            lines = metrics.read().decode().splitlines()
        transfers = [line for line in lines if line.startswith("splitserve_kv_transfers_total{")]
        assert transfers and float(transfers[0].split()[-1]) >= 1, transfers

        with grpc.insecure_channel(stack.grpc_address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
