"""Random and mutated protobuf messages at every worker RPC (Prefill.Prefill, Prefill.Health,
Decode.Generate, Decode.Health) of real worker processes serving a tiny random model: no call
ends in an unhandled error (UNKNOWN), no call hangs, and afterwards both workers still serve a
good request with the engine's exact output. Bounded for CI (hypothesis max_examples)."""

from __future__ import annotations

import asyncio
import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from splitserve.v1 import common_pb2, decode_pb2, prefill_pb2

from engine.sampling_params import SamplingParams
from splitserve_cli.processes import start_worker
from tests.services.flows import disaggregated, greedy

# `make fuzz` raises it (SPLITSERVE_FUZZ_EXAMPLES) for a longer run.
EXAMPLES = int(os.environ.get("SPLITSERVE_FUZZ_EXAMPLES", 60))
pytestmark = pytest.mark.timeout(240 + 3 * EXAMPLES)

CALL_TIMEOUT_S = 20.0
# The message reads of one Generate call; its stream is then cancelled (a fuzzed request may
# ask for thousands of tokens).
MAX_STREAM_READS = 2
METHODS = {
    "prefill": "/splitserve.v1.Prefill/Prefill",
    "prefill_health": "/splitserve.v1.Prefill/Health",
    "generate": "/splitserve.v1.Decode/Generate",
    "decode_health": "/splitserve.v1.Decode/Health",
}


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64",
                          "--kv-wait-timeout-s", "2")
    try:
        prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64")
    except Exception:
        decode.kill()
        raise
    yield decode, prefill
    decode.kill()
    prefill.kill()


U32 = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan]),
                   st.floats(width=32))

sampling = st.builds(
    common_pb2.SamplingParams,
    max_tokens=st.one_of(st.integers(0, 8), U32), temperature=FLOATS, has_temperature=st.booleans(),
    top_p=FLOATS, top_k=st.integers(-(2**31), 2**31 - 1), min_p=FLOATS,
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)), repetition_penalty=FLOATS,
    presence_penalty=FLOATS, frequency_penalty=FLOATS,
    stop_token_ids=st.lists(U32, max_size=4), ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), U32), prompt_logprobs=st.one_of(st.none(), U32),
    disable_speculation=st.booleans(),
)
request_ids = st.one_of(st.text(max_size=8), st.text(min_size=60, max_size=300))
prompts = st.lists(st.one_of(st.integers(0, 600), U32), max_size=40)
models = st.one_of(st.just(""), st.text(max_size=12))
priorities = st.integers(-(2**31), 2**31 - 1)
endpoints = st.one_of(st.just(""), st.text(max_size=30),
                      st.builds("127.0.0.1:{}".format, st.integers(0, 70000)),
                      st.just("10.0.0.1:5000"))

prefill_requests = st.builds(prefill_pb2.PrefillRequest, request_id=request_ids, model=models,
                             prompt_token_ids=prompts, sampling=sampling,
                             decode_kv_endpoint=endpoints, priority=priorities)
generate_requests = st.builds(decode_pb2.GenerateRequest, request_id=request_ids, model=models,
                              prompt_token_ids=prompts, sampling=sampling,
                              remote_prefill=st.booleans(), priority=priorities)


@st.composite
def mutated(draw, messages) -> bytes:
    """A message's wire bytes, then truncated, with bytes flipped, or with junk inserted."""
    raw = bytearray(draw(messages).SerializeToString())
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        if op == "flip" and raw:
            i = draw(st.integers(0, len(raw) - 1))
            raw[i] ^= draw(st.integers(1, 255))
        elif op == "cut" and raw:
            del raw[draw(st.integers(0, len(raw) - 1)):]
        else:
            i = draw(st.integers(0, len(raw)))
            raw[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(raw)


calls = st.one_of(
    st.tuples(st.just("prefill"), prefill_requests.map(lambda m: m.SerializeToString())),
    st.tuples(st.just("prefill"), mutated(prefill_requests)),
    st.tuples(st.just("generate"), generate_requests.map(lambda m: m.SerializeToString())),
    st.tuples(st.just("generate"), mutated(generate_requests)),
    st.tuples(st.sampled_from(["prefill_health", "decode_health"]), st.binary(max_size=20)),
)


async def call_raw(address: str, method: str, payload: bytes) -> grpc.StatusCode:
    """One call with the payload as its exact wire bytes; the status it ended with."""
    async with grpc.aio.insecure_channel(address) as channel:
        path = METHODS[method]
        try:
            if method == "generate":
                stream = channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S)
                for _ in range(MAX_STREAM_READS):
                    if await stream.read() is grpc.aio.EOF:
                        break
                stream.cancel()
            else:
                await channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(call=calls)
def test_no_message_makes_a_worker_rpc_fail_unhandled(workers, call):
    decode, prefill = workers
    method, payload = call
    address = prefill.address if method.startswith("prefill") else decode.address
    code = asyncio.run(call_raw(address, method, payload))
    # UNKNOWN is what grpc answers for an exception the handler did not turn into a status;
    # DEADLINE_EXCEEDED here would be a call that hung.
    assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED), \
        (method, payload, code)


def test_both_workers_serve_a_good_request_after_the_fuzzing(workers, reference_engine):
    decode, prefill = workers
    prompt = list(range(30, 60))
    tokens = asyncio.run(disaggregated(decode.address, prefill.address, "after-fuzz", prompt,
                                       greedy(6)))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, seed=7)
    assert tokens == reference_engine.generate([prompt], params)[0].token_ids
    for worker in (decode, prefill):
        assert worker.process.poll() is None
        assert worker.health().status == common_pb2.HealthResponse.SERVING
    decode.wait_for(lambda h: h.stats.kv_blocks_free == h.stats.kv_blocks_total, what="idle")
