"""W3C trace context in gRPC metadata: prefill and decode spans join the caller's trace,
with their phase spans parented under them."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import pytest
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from splitserve_cli.processes import start_worker
from tests.services.flows import greedy, read_deltas

pytestmark = pytest.mark.timeout(120)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def test_worker_spans_join_the_callers_trace(tiny_llama_dir, tmp_path):
    trace_file = tmp_path / "spans.jsonl"
    env = {"SPLITSERVE_TRACE_FILE": str(trace_file)}
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64", env=env)
    prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64", env=env)
    metadata = [("traceparent", f"00-{TRACE_ID}-{CALLER_SPAN}-01")]
    try:
        async def run():
            prompt = list(range(20, 60))
            async with grpc.aio.insecure_channel(decode.address) as dch, \
                    grpc.aio.insecure_channel(prefill.address) as pch:
                stream = decode_pb2_grpc.DecodeStub(dch).Generate(decode_pb2.GenerateRequest(
                    request_id="traced", prompt_token_ids=prompt, sampling=greedy(6),
                    remote_prefill=True), metadata=metadata)
                first = await stream.read()
                await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                    request_id="traced", prompt_token_ids=prompt, sampling=greedy(6),
                    decode_kv_endpoint=first.reserved.kv_endpoint), metadata=metadata)
                return await read_deltas(stream, [0])

        assert len(asyncio.run(run())) == 6
        deadline = time.monotonic() + 10
        names = set()
        while time.monotonic() < deadline:
            spans = [json.loads(line) for line in trace_file.read_text().splitlines()] \
                if trace_file.exists() else []
            names = {s["name"] for s in spans}
            if {"prefill", "prefill.queue", "prefill.forward", "prefill.kv_send", "decode",
                    "decode.kv_wait", "decode.first_step"} <= names:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"spans missing; have {names}")
        by_name = {s["name"]: s for s in spans}
        assert {s["trace_id"] for s in spans} == {TRACE_ID}
        assert by_name["prefill"]["parent_id"] == CALLER_SPAN
        assert by_name["decode"]["parent_id"] == CALLER_SPAN
        assert by_name["prefill"]["service"] == "splitserve-prefill"
        assert by_name["decode"]["service"] == "splitserve-decode"
        for child in ("prefill.queue", "prefill.forward", "prefill.kv_send"):
            assert by_name[child]["parent_id"] == by_name["prefill"]["span_id"], child
        for child in ("decode.kv_wait", "decode.first_step"):
            assert by_name[child]["parent_id"] == by_name["decode"]["span_id"], child
        assert by_name["prefill.kv_send"]["attributes"]["splitserve.transfer_bytes"] > 0
        assert by_name["decode"]["attributes"]["splitserve.output_tokens"] == 6
    finally:
        decode.kill()
        prefill.kill()


def test_a_stream_its_reader_cancels_ends_its_span_without_a_context_error(tiny_llama_dir,
                                                                          tmp_path):
    """gRPC closes the servicer's generator at a yield, from another context than the one that
    started it; a span made current there could not be detached (an error log per stream)."""
    trace_file = tmp_path / "spans.jsonl"
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64",
                          env={"SPLITSERVE_TRACE_FILE": str(trace_file)})
    try:
        async def run():
            async with grpc.aio.insecure_channel(decode.address) as channel:
                for i in range(3):
                    stream = decode_pb2_grpc.DecodeStub(channel).Generate(
                        decode_pb2.GenerateRequest(request_id=f"cut-{i}",
                                                   prompt_token_ids=list(range(20, 40)),
                                                   sampling=greedy(200)))
                    await stream.read()
                    await stream.read()
                    stream.cancel()

        asyncio.run(run())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lines = trace_file.read_text().splitlines() if trace_file.exists() else []
            if sum(json.loads(line)["name"] == "decode" for line in lines) == 3:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the cancelled streams' spans never ended")
        assert "Failed to detach context" not in decode.output
    finally:
        decode.kill()
