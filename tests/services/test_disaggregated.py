"""Prefill and decode as real processes, KV over real gloo channels: outputs must equal the
engine alone, cancellation must return every block, bad rpcs must not hurt the workers."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from engine.sampling_params import SamplingParams
from splitserve_cli.processes import start_worker
from tests.services.flows import aggregated, disaggregated, greedy

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def workers(tiny_llama_dir):
    started = []
    try:
        decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "256")
        started.append(decode)
        prefills = [start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "256")
                    for _ in range(2)]
        started.extend(prefills)
        yield decode, prefills
    finally:
        for worker in started:
            worker.kill()


def mixed_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(rng.choice([3, 15, 16, 17, 40, 90]))]
            for _ in range(n)]


def expected(reference_engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=7)
    return [r.token_ids for r in reference_engine.generate(prompts, params)]


def test_16_concurrent_requests_match_the_engine_alone(workers, reference_engine):
    decode, (prefill, _) = workers
    prompts = mixed_prompts(16, seed=1)

    async def run():
        return await asyncio.gather(*[
            disaggregated(decode.address, prefill.address, f"one-{i}", p, greedy(12))
            for i, p in enumerate(prompts)])

    assert asyncio.run(run()) == expected(reference_engine, prompts, 12)
    decode.wait_for(lambda h: h.stats.kv_blocks_free == h.stats.kv_blocks_total, what="idle")


def test_two_prefill_workers_feed_one_decode_worker(workers, reference_engine):
    decode, prefills = workers
    prompts = mixed_prompts(16, seed=2)

    async def run():
        return await asyncio.gather(*[
            disaggregated(decode.address, prefills[i % 2].address, f"two-{i}", p, greedy(10))
            for i, p in enumerate(prompts)])

    assert asyncio.run(run()) == expected(reference_engine, prompts, 10)
    for prefill in prefills:
        assert prefill.health().stats.computed_tokens > 0


def test_aggregated_mode_matches_disaggregated(workers, reference_engine):
    decode, _ = workers
    prompt = mixed_prompts(1, seed=3)[0]
    tokens = asyncio.run(aggregated(decode.address, "agg-1", prompt, greedy(16)))
    assert tokens == expected(reference_engine, [prompt], 16)[0]


def test_cancel_before_kv_arrives_frees_blocks(workers):
    decode, _ = workers
    baseline = decode.health().stats.kv_blocks_total

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as ch:
            stream = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                request_id="cancel-early", prompt_token_ids=list(range(5, 70)),
                sampling=greedy(50), remote_prefill=True))
            first = await stream.read()
            assert first.reserved.num_blocks == 5
            assert decode.health().stats.kv_blocks_free == baseline - 5
            stream.cancel()

    asyncio.run(run())
    decode.wait_for(lambda h: h.stats.kv_blocks_free == baseline and h.stats.waiting_for_kv == 0,
                    what="blocks back after cancel")


def test_cancel_mid_stream_frees_blocks(workers):
    decode, (prefill, _) = workers
    baseline = decode.health().stats.kv_blocks_total

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as dch, \
                grpc.aio.insecure_channel(prefill.address) as pch:
            prompt = list(range(5, 60))
            stream = decode_pb2_grpc.DecodeStub(dch).Generate(decode_pb2.GenerateRequest(
                request_id="cancel-mid", prompt_token_ids=prompt, sampling=greedy(400),
                remote_prefill=True))
            first = await stream.read()
            await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                request_id="cancel-mid", prompt_token_ids=prompt, sampling=greedy(400),
                decode_kv_endpoint=first.reserved.kv_endpoint))
            for _ in range(3):
                message = await stream.read()
                assert message.delta.token_ids
            assert decode.health().stats.running == 1
            stream.cancel()

    asyncio.run(run())
    decode.wait_for(lambda h: h.stats.kv_blocks_free == baseline and h.stats.running == 0,
                    what="blocks back after mid-stream cancel")


def test_prefill_cancelled_while_queued_is_never_computed(tiny_llama_dir):
    # A small step budget keeps the first prompt busy for many steps, so the second waits.
    prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "128",
                           "--max-num-batched-tokens", "4", "--long-prefill-token-threshold", "4")
    try:
        long_prompt = [5 + i % 600 for i in range(480)]

        async def run():
            async with grpc.aio.insecure_channel(prefill.address) as ch:
                stub = prefill_pb2_grpc.PrefillStub(ch)
                busy = asyncio.ensure_future(stub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="busy", prompt_token_ids=long_prompt, sampling=greedy(1))))
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, lambda: prefill.wait_for(
                    lambda h: h.stats.running == 1, what="busy", interval=0.005))
                queued = stub.Prefill(prefill_pb2.PrefillRequest(
                    request_id="queued", prompt_token_ids=list(range(600, 700)), sampling=greedy(1)))
                await loop.run_in_executor(None, lambda: prefill.wait_for(
                    lambda h: h.stats.waiting == 1, what="queued", interval=0.005))
                queued.cancel()
                await busy

        asyncio.run(run())
        health = prefill.wait_for(lambda h: h.stats.waiting == 0 and h.stats.running == 0,
                                  what="idle")
        assert health.stats.computed_tokens == len(long_prompt)
    finally:
        prefill.kill()


MALFORMED = {
    "empty prompt": dict(prompt_token_ids=[], sampling=greedy(4)),
    "token outside vocab": dict(prompt_token_ids=[1, 2, 10**6], sampling=greedy(4)),
    "unknown model": dict(model="gpt-17", prompt_token_ids=[5, 6], sampling=greedy(4)),
    "absurd max_tokens": dict(prompt_token_ids=[5, 6], sampling=greedy(4_000_000_000)),
    "negative temperature": dict(prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(
        max_tokens=4, temperature=-1.0, has_temperature=True)),
    "top_p above one": dict(prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(
        max_tokens=4, top_p=2.0)),
    "prompt longer than context": dict(prompt_token_ids=[5] * 600, sampling=greedy(4)),
    "stop id outside vocab": dict(prompt_token_ids=[5, 6], sampling=common_pb2.SamplingParams(
        max_tokens=4, stop_token_ids=[99999])),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_rpcs_get_invalid_argument(workers, case, reference_engine):
    decode, (prefill, _) = workers
    fields = MALFORMED[case]
    with decode.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(decode_pb2_grpc.DecodeStub(ch).Generate(
                decode_pb2.GenerateRequest(request_id=f"bad-d-{case}", **fields), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    with prefill.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(
                prefill_pb2.PrefillRequest(request_id=f"bad-p-{case}", **fields), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    # Both workers still serve correct results.
    prompt = [9, 8, 7, 6, 5]
    tokens = asyncio.run(disaggregated(decode.address, prefill.address, f"after-{case}",
                                       prompt, greedy(5)))
    assert tokens == expected(reference_engine, [prompt], 5)[0]
