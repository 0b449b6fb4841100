"""Tensor-parallel workers as real processes: a TP=2 prefill worker feeding a TP=2 decode
worker rank to rank gives the tokens of the one-rank engine, unequal degrees are refused with
an error naming both, and a killed rank takes its worker down while the gateway routes around it."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import httpx
import pytest
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from splitserve_cli.processes import start_worker
from tests.gateway.gateway_processes import start_gateway
from tests.gateway.gateway_processes import start_worker as start_service_worker
from tests.services.flows import aggregated, disaggregated, disaggregated_reusing, greedy

pytestmark = pytest.mark.timeout(300)
# Parity is judged in float32 (DESIGN.md): bfloat16 results depend on the batch's makeup.
FLOAT32 = ("--dtype", "float32", "--num-kv-blocks", "128")
TP2 = ("--tensor-parallel-size", "2", *FLOAT32)


@pytest.fixture(scope="module")
def reference_engine(tiny_llama_dir):
    """One rank, in this process: what every tensor-parallel run must reproduce."""
    return LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=512))


@pytest.fixture(scope="module")
def tp2_pair(tiny_llama_dir):
    started = []
    try:
        # A short wait for KV, so a refused transfer falls back to recomputing quickly.
        decode = start_worker("decode", tiny_llama_dir, *TP2, "--kv-wait-timeout-s", "8")
        started.append(decode)
        prefill = start_worker("prefill", tiny_llama_dir, *TP2)
        started.append(prefill)
        yield decode, prefill
    finally:
        for worker in started:
            worker.kill()


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(rng.choice([3, 16, 17, 40]))] for _ in range(n)]


def _expected(reference_engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=7)
    return [r.token_ids for r in reference_engine.generate(prompts, params)]


def test_tp2_prefill_to_tp2_decode_matches_one_rank(tp2_pair, reference_engine):
    decode, prefill = tp2_pair
    assert len(decode.kv_endpoint.split(",")) == 2 and len(decode.rank_pids) == 1
    prompts = _prompts(8, seed=1)
    computed_before = decode.health().stats.computed_tokens

    async def run():
        return await asyncio.gather(*[
            disaggregated(decode.address, prefill.address, f"tp-{i}", p, greedy(10))
            for i, p in enumerate(prompts)])

    assert asyncio.run(run()) == _expected(reference_engine, prompts, 10)
    health = decode.wait_for(lambda h: h.stats.kv_blocks_free == h.stats.kv_blocks_total,
                             what="every block back")
    # Only the 9 decode steps of each request ran there: no prompt was recomputed.
    assert health.stats.computed_tokens - computed_before == 9 * len(prompts)


def test_tp2_decode_reuses_its_cached_prefix_and_takes_the_rest_from_every_rank(
        tp2_pair, reference_engine):
    decode, prefill = tp2_pair
    block = decode.health().block_size
    shared = [400 + i % 80 for i in range(2 * block + 2)]
    prompts = [shared + [7, 8], shared + [9, 10, 11]]
    computed_before = decode.health().stats.computed_tokens

    async def run(rid, prompt):
        return await disaggregated_reusing(decode.address, prefill.address, rid, prompt,
                                           greedy(6))

    results = [asyncio.run(run(f"tp-reuse-{i}", p)) for i, p in enumerate(prompts)]
    assert [tokens for tokens, _, _ in results] == _expected(reference_engine, prompts, 6)
    assert [reserved.num_cached_tokens for _, reserved, _ in results] == [0, 2 * block]
    assert results[1][2].kv_bytes * 3 == results[0][2].kv_bytes
    health = decode.wait_for(lambda h: h.stats.running == 0, what="idle")
    assert health.stats.computed_tokens - computed_before == 5 * len(prompts)


def test_tp2_aggregated_matches_one_rank(tp2_pair, reference_engine):
    decode, _ = tp2_pair
    prompt = _prompts(1, seed=2)[0]
    tokens = asyncio.run(aggregated(decode.address, "tp-agg", prompt, greedy(12)))
    assert tokens == _expected(reference_engine, [prompt], 12)[0]


def test_unequal_tp_degrees_fail_the_prefill_call_with_a_clear_error(tp2_pair, tiny_llama_dir):
    decode, _ = tp2_pair
    prefill = start_worker("prefill", tiny_llama_dir, *FLOAT32)
    try:
        prompt = _prompts(1, seed=3)[0]

        async def run() -> grpc.aio.AioRpcError:
            async with grpc.aio.insecure_channel(decode.address) as dch, \
                    grpc.aio.insecure_channel(prefill.address) as pch:
                stream = decode_pb2_grpc.DecodeStub(dch).Generate(decode_pb2.GenerateRequest(
                    request_id="tp-mismatch", prompt_token_ids=prompt, sampling=greedy(6),
                    remote_prefill=True))
                first = await stream.read()
                # Refused before anything is sent, and said at once: the caller retries the
                # attempt elsewhere instead of the decode worker waiting for KV.
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                        request_id="tp-mismatch", prompt_token_ids=prompt, sampling=greedy(6),
                        decode_kv_endpoint=first.reserved.kv_endpoint), timeout=30)
                stream.cancel()
                return err.value

        error = asyncio.run(run())
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert ("tensor-parallel degree mismatch: decode worker has TP=2, prefill worker TP=1"
                in error.details()), error.details()
        decode.wait_for(lambda h: h.stats.kv_blocks_free == h.stats.kv_blocks_total
                        and h.stats.waiting_for_kv == 0, what="every block back")
    finally:
        prefill.kill()


def test_killing_a_rank_takes_the_worker_down_and_the_gateway_routes_around_it(tiny_llama_dir):
    tp2 = start_service_worker(tiny_llama_dir, "both", "--tensor-parallel-size", "2")
    single = start_service_worker(tiny_llama_dir, "both")
    gateway = None
    try:
        tp2.wait_ready()
        single.wait_ready()
        gateway = start_gateway(tiny_llama_dir, "--worker", tp2.address, "--worker", single.address)
        url = f"http://{gateway.address}/v1/completions"
        body = {"model": tiny_llama_dir.name, "prompt": "hello", "max_tokens": 4}
        for _ in range(4):
            assert httpx.post(url, json=body, timeout=60).status_code == 200

        rank1 = int(tp2.field("tp_pids"))
        signal_sent = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        assert tp2.process.wait(timeout=30) != 0
        assert time.monotonic() - signal_sent < 30
        assert "tensor-parallel rank 1" in tp2.output()

        for i in range(6):
            response = httpx.post(url, json={**body, "prompt": f"hello {i}"}, timeout=60)
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["finish_reason"] == "length"
    finally:
        for process in (gateway, tp2, single):
            if process is not None:
                process.stop()
