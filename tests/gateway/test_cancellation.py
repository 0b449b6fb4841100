"""A client that goes away (HTTP disconnect, gRPC cancel) or stops reading, and a stop string
that matches, get the request aborted on the workers: the decode worker's free KV blocks return
to their baseline, checked through its Health stats with a deadline, long before the request
could have finished."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from gateway_processes import (
    ServiceProcess,
    Stack,
    openai_client,
    start_gateway,
    start_worker,
    worker_stats,
)
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# The tiny model with a 4096-token context: a request that is not aborted runs for seconds, so
# "aborted" is told apart from "finished anyway" (the 512-token model finishes any request in
# about half a second, faster than a loaded machine may notice a disconnect).
MAX_TOKENS = 4000
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-long"), arch="llama", seed=0,
                            max_position_embeddings=MAX_TOKENS + 96)


@pytest.fixture(scope="module")
def long_workers(long_model) -> Iterator[dict[str, ServiceProcess]]:
    blocks = ("--num-kv-blocks", "300")
    workers = {role: start_worker(long_model, role, *blocks) for role in ("prefill", "decode", "both")}
    try:
        yield {role: w.wait_ready() for role, w in workers.items()}
    finally:
        for worker in workers.values():
            worker.stop()


@pytest.fixture(scope="module", params=["disagg", "agg"])
def long_stack(request, long_model, long_workers) -> Iterator[Stack]:
    if request.param == "disagg":
        routing = ("--prefill", long_workers["prefill"].address,
                   "--decode", long_workers["decode"].address)
        decode = long_workers["decode"]
    else:
        routing = ("--worker", long_workers["both"].address)
        decode = long_workers["both"]
    gateway = start_gateway(long_model, *routing)
    try:
        yield Stack(gateway, decode)
    finally:
        gateway.stop()


def _wait_for_baseline(decode_address: str, baseline: common_pb2.WorkerStats) -> tuple[float, common_pb2.WorkerStats]:
    """Seconds until the decode worker holds no request and has all its blocks back."""
    start = time.perf_counter()
    while time.perf_counter() - start < DEADLINE_S:
        stats = worker_stats(decode_address)
        if (stats.kv_blocks_free == baseline.kv_blocks_free and stats.running == 0
                and stats.waiting == 0 and stats.waiting_for_kv == 0):
            return time.perf_counter() - start, stats
        time.sleep(0.002)
    raise AssertionError(f"blocks not freed within {DEADLINE_S}s: {worker_stats(decode_address)}")


def _long_request(model: str) -> dict:
    return {"model": model, "prompt": "The engineer reads", "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True}


def test_client_disconnect_mid_stream_frees_decode_blocks(long_stack, long_model, record_property):
    stack = long_stack
    baseline = stack.decode_stats()
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{stack.url}/v1/completions",
                           json=_long_request(long_model.name)) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                if chunks == 3:
                    break
            disconnected_at = time.perf_counter()
        # Leaving both blocks closed the connection mid-stream.
    _, stats = _wait_for_baseline(stack.decode.address, baseline)
    latency = time.perf_counter() - disconnected_at
    decode_steps = stats.steps - baseline.steps
    record_property("disconnect_to_blocks_freed_s", round(latency, 4))
    print(f"\ndisconnect -> decode blocks freed: {latency * 1e3:.1f} ms "
          f"(after {decode_steps} decode steps)")
    assert decode_steps < MAX_TOKENS // 2, (
        f"the request ran on: it was not aborted\n{stack.gateway.output()}")


def test_grpc_cancel_mid_stream_frees_decode_blocks(long_stack, record_property):
    stack = long_stack
    baseline = stack.decode_stats()
    with grpc.insecure_channel(stack.grpc_address) as channel:
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(gateway_pb2.GenerateTextRequest(
            text="The engineer reads", sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, has_temperature=True)))
        for _, response in zip(range(3), call, strict=False):
            assert response.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        call.cancel()
        cancelled_at = time.perf_counter()
    _, stats = _wait_for_baseline(stack.decode.address, baseline)
    latency = time.perf_counter() - cancelled_at
    record_property("grpc_cancel_to_blocks_freed_s", round(latency, 4))
    print(f"\ngRPC cancel -> decode blocks freed: {latency * 1e3:.1f} ms")
    assert stats.steps - baseline.steps < MAX_TOKENS // 2, "the request was not aborted"


def test_stop_string_match_cancels_the_worker_request(long_stack, long_model):
    client = openai_client(long_stack.url)
    request = {"model": long_model.name, "prompt": "The engineer reads", "temperature": 0,
               "extra_body": {"ignore_eos": True}}
    text = client.completions.create(max_tokens=30, **request).choices[0].text
    stop = next(text[i:i + 3] for i in range(12, 27) if text[i:i + 3].strip() == text[i:i + 3])
    baseline = long_stack.decode_stats()
    stopped = client.completions.create(max_tokens=MAX_TOKENS, stop=stop, **request)
    assert stopped.choices[0].text == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    _, stats = _wait_for_baseline(long_stack.decode.address, baseline)
    assert stats.steps - baseline.steps < MAX_TOKENS // 2, "the worker ran on after the stop"


def test_client_that_stops_reading_is_cut_off_and_its_request_aborted(long_model, long_workers):
    worker = long_workers["both"]
    gateway = start_gateway(long_model, "--worker", worker.address, "--slow-client-timeout-s", "0.5",
                            "--stream-buffer-chunks", "2", "--socket-send-buffer", "4096")
    try:
        _assert_slow_client_cut_off(gateway, worker, long_model.name, max_tokens=MAX_TOKENS)
        # A deliberate cut, logged once as a warning: uvicorn's "ASGI callable returned
        # without completing response" at ERROR, in its own plain-text format between the
        # JSON lines, came with every one.
        logged = [line for line in gateway.lines if not line.startswith("SPLITSERVE_READY")]
        entries = [json.loads(line) for line in logged]  # every line JSON
        assert not [e for e in entries if e["level"] == "error"], entries
        assert [e["message"] for e in entries if e["level"] == "warning"] == [
            "client read nothing for 0.5s; cutting it off and aborting the request"]
    finally:
        gateway.stop()


def test_a_grpc_caller_that_stops_reading_frees_its_slot_and_worker_at_once(
        long_model, long_workers):
    """The front door times out a write the caller does not take; the workers and the
    admission slot are freed then, while the caller still holds its call unread. Before, the
    handler waited in abort() for a status that queued behind the untaken write, so the
    request ran on to max_tokens and the slot stayed taken as long as the caller stayed
    connected (an audit: four such callers held every slot, and every HTTP request got 503)."""
    worker = long_workers["both"]
    gateway = start_gateway(long_model, "--worker", worker.address,
                            "--slow-client-timeout-s", "0.5")
    channel = None
    try:
        # A small flow-control window the caller never opens again: nothing is read.
        channel = grpc.insecure_channel(gateway.field("grpc"), options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16384)])
        baseline = worker_stats(worker.address)
        request = gateway_pb2.GenerateTextRequest(
            text="The engineer reads", sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0, has_temperature=True, ignore_eos=True,
                logprobs=20))
        call = gateway_pb2_grpc.GatewayStub(channel).Generate(request, timeout=120)
        _, stats = _wait_for_baseline(worker.address, baseline)
        assert stats.steps - baseline.steps < MAX_TOKENS // 2, "the request was not aborted"
        _wait_for_metric(gateway, "splitserve_gateway_inflight_requests", 0)
        assert not call.done() or call.code() != grpc.StatusCode.OK
    finally:
        if channel is not None:
            channel.close()
        gateway.stop()


def _wait_for_metric(gateway, name: str, value: float, timeout_s: float = 10.0) -> None:
    url = f"http://{gateway.admin_address}/metrics"
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [line for line in httpx.get(url, timeout=5).text.splitlines()
                 if line.startswith(name + " ")]
        if lines and float(lines[0].split()[1]) == value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} is {lines}, not {value}")
        time.sleep(0.05)


def _assert_slow_client_cut_off(gateway, worker, model_name: str, max_tokens: int) -> None:
    host, port = gateway.address.rsplit(":", 1)
    baseline = worker_stats(worker.address)
    # Big chunks (20 alternatives per token) fill the socket buffers after a few dozen tokens.
    body = json.dumps({"model": model_name, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                       "logprobs": True, "top_logprobs": 20}).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        first = sock.recv(256)
        assert first.startswith(b"HTTP/1.1 200"), first
        # ... and now read nothing: the gateway must give up on us after ~0.5 s.
        _, stats = _wait_for_baseline(worker.address, baseline)
        assert stats.steps - baseline.steps < max_tokens // 2, "the request was not aborted"
        # Still reading nothing, the connection goes too (reset once it took nothing for the
        # slow-client timeout): before, asyncio's close waited for us to read what it held.
        _wait_for_metric(gateway, "splitserve_gateway_open_connections", 0)
        sock.settimeout(10)
        rest = bytearray()
        try:
            while chunk := sock.recv(1 << 16):
                rest += chunk
        except ConnectionResetError:
            pass
    finally:
        sock.close()
    # What was buffered arrives, then the connection closes without an end to the stream.
    assert b"[DONE]" not in rest and b'"finish_reason":"length"' not in rest, (
        f"the stream was completed, not cut off ({len(rest)} bytes, "
        f"{stats.steps - baseline.steps} steps): ...{bytes(rest[-300:])!r}")
    assert gateway.alive()
