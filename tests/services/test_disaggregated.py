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
from tests.metrics_text import scrape_worker
from tests.services.flows import aggregated, disaggregated, disaggregated_reusing, greedy

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


def all_at_once(decode, prefills, name: str, prompts, max_tokens: int) -> list[list[int]]:
    """Every prompt's disaggregated flow at once, the prefill workers taking turns."""

    async def run():
        return await asyncio.gather(*[
            disaggregated(decode.address, prefills[i % len(prefills)].address, f"{name}-{i}", p,
                          greedy(max_tokens))
            for i, p in enumerate(prompts)])

    return asyncio.run(run())


def test_16_concurrent_requests_match_the_engine_alone(workers, reference_engine):
    decode, (prefill, _) = workers
    prompts = mixed_prompts(16, seed=1)
    assert all_at_once(decode, [prefill], "one", prompts, 12) == expected(reference_engine,
                                                                           prompts, 12)
    decode.wait_for(lambda h: h.stats.kv_blocks_free == h.stats.kv_blocks_total, what="idle")


def test_a_burst_past_the_kv_queue_waits_for_room_and_is_served(workers, reference_engine,
                                                                  tiny_llama_dir):
    """A prefill worker whose queue to the decode worker holds one transfer gets 16 prompts at
    once: each computed prompt's KV waits for room, where the call used to fail UNAVAILABLE
    (the KV thrown away, the gateway retrying from scratch and opening the worker's circuit),
    and every answer equals the engine alone's."""
    decode, _ = workers
    prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "256",
                           "--max-queued-kv-transfers", "1")
    try:
        prompts = mixed_prompts(16, seed=5)
        assert all_at_once(decode, [prefill], "queued", prompts, 6) == expected(
            reference_engine, prompts, 6)
        waited = scrape_worker(prefill).get('splitserve_kv_transfer_queue_full_total{role="prefill"}')
        assert waited, "the queue never filled: the test proves nothing"
    finally:
        prefill.kill()
    decode.wait_for(lambda h: h.stats.kv_blocks_free == h.stats.kv_blocks_total, what="idle")


def test_two_prefill_workers_feed_one_decode_worker(workers, reference_engine):
    decode, prefills = workers
    prompts = mixed_prompts(16, seed=2)
    assert all_at_once(decode, prefills, "two", prompts, 10) == expected(reference_engine,
                                                                          prompts, 10)
    for prefill in prefills:
        assert prefill.health().stats.computed_tokens > 0


def test_aggregated_mode_matches_disaggregated(workers, reference_engine):
    decode, _ = workers
    prompt = mixed_prompts(1, seed=3)[0]
    tokens = asyncio.run(aggregated(decode.address, "agg-1", prompt, greedy(16)))
    assert tokens == expected(reference_engine, [prompt], 16)[0]


def test_a_prefix_the_decode_worker_holds_is_not_sent_again(workers, reference_engine):
    """Two prompts share 3 blocks. The second's reservation adopts them from the decode
    worker's cache, the prefill worker sends one block, not four, and the decode worker
    computes no prompt token: its tokens still equal the engine alone's."""
    decode, (prefill, _) = workers
    block = decode.health().block_size
    shared = [600 + i % 90 for i in range(3 * block + 5)]
    first_prompt, second_prompt = shared + [11, 12, 13], shared + [21, 22, 23, 24]
    computed_before = decode.health().stats.computed_tokens

    async def run(rid, prompt):
        return await disaggregated_reusing(decode.address, prefill.address, rid, prompt, greedy(8))

    tokens, reserved, whole = asyncio.run(run("reuse-1", first_prompt))
    assert reserved.num_cached_tokens == 0 and reserved.num_blocks == 4
    assert tokens == expected(reference_engine, [first_prompt], 8)[0]
    tokens, reserved, partial = asyncio.run(run("reuse-2", second_prompt))
    assert reserved.num_cached_tokens == 3 * block and reserved.num_blocks == 1
    assert partial.kv_bytes * 4 == whole.kv_bytes
    assert tokens == expected(reference_engine, [second_prompt], 8)[0]
    # Seven decode steps each; a prompt recomputed here (a refused frame) would add dozens.
    health = decode.wait_for(lambda h: h.stats.running == 0, what="idle")
    assert health.stats.computed_tokens - computed_before == 2 * 7


def test_whole_prompt_kv_after_a_reuse_is_refused_and_recomputed(workers, reference_engine):
    """A prefill worker that does not know decode_cached_tokens (a rolling update) sends the
    whole prompt's KV: the decode worker refuses the frame and computes the prompt itself, so
    the request still ends right."""
    decode, (prefill, _) = workers
    block = decode.health().block_size
    shared = [300 + i % 70 for i in range(2 * block + 3)]
    prompt = shared + [31, 32]

    async def run(rid, prompt, tell_prefill):
        return await disaggregated_reusing(decode.address, prefill.address, rid, prompt,
                                           greedy(6), tell_prefill=tell_prefill)

    asyncio.run(run("old-1", shared + [41], True))
    tokens, reserved, _ = asyncio.run(run("old-2", prompt, False))
    assert reserved.num_cached_tokens == 2 * block
    assert tokens == expected(reference_engine, [prompt], 6)[0]


@pytest.mark.parametrize("cached", [5, 48, 10**6], ids=["not whole blocks", "the whole prompt",
                                                      "past it"])
def test_a_bad_decode_cached_tokens_gets_invalid_argument(workers, cached):
    _, (prefill, _) = workers
    with prefill.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            prefill_pb2_grpc.PrefillStub(ch).Prefill(prefill_pb2.PrefillRequest(
                request_id=f"bad-cached-{cached}", prompt_token_ids=[5 + i for i in range(48)],
                sampling=greedy(4), decode_cached_tokens=cached), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "multiple of the block size" in err.value.details()


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
