"""Worker-side bounds with real processes, real gRPC and real gloo KV channels: any request id
travels through a KV transfer, an ABORT frame makes the decode worker recompute at once, a
transfer that cannot be queued fails the Prefill call, and a reservation whose KV never comes
is settled by its own bound, well before --kv-wait-timeout-s."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from engine.sampling_params import SamplingParams
from kv_transfer import KVSenderPool, transfer_key
from services.common.server import kv_layout_of
from splitserve_cli.processes import start_worker
from tests.services.flows import disaggregated, greedy, read_deltas

pytestmark = pytest.mark.timeout(240)

LONG_IDS = [
    "x" * 64 + "a" * 136,  # 200 characters; the two share their first 64 bytes
    "x" * 64 + "b" * 136,
    "é" * 100,  # 100 characters, 200 bytes of UTF-8
]


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    started = []
    try:
        # --kv-wait-timeout-s and the reservation TTL at 60 s: anything recomputed within these
        # tests was recomputed because of what the test did, not by a timer.
        decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "256",
                              "--kv-reservation-ttl-s", "60")
        started.append(decode)
        prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "256")
        started.append(prefill)
        yield decode, prefill
    finally:
        for worker in started:
            worker.kill()


def expected(reference_engine, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=7)
    return [r.token_ids for r in reference_engine.generate(prompts, params)]


def idle(health) -> bool:
    s = health.stats
    return (s.kv_blocks_free == s.kv_blocks_total and s.running == 0 and s.waiting == 0
            and s.waiting_for_kv == 0)


def test_request_ids_of_any_length_travel_through_a_real_transfer(pair, reference_engine):
    decode, prefill = pair
    prompts = [list(range(10 + 50 * i, 50 + 50 * i)) for i in range(len(LONG_IDS))]
    computed_before = decode.health().stats.computed_tokens

    async def run():
        return await asyncio.gather(*[
            disaggregated(decode.address, prefill.address, rid, p, greedy(6))
            for rid, p in zip(LONG_IDS, prompts, strict=True)])

    assert asyncio.run(run()) == expected(reference_engine, prompts, 6)
    health = decode.wait_for(idle, what="idle after long ids")
    # The KV came over the wire: decode ran only the 5 decode steps of each request.
    assert health.stats.computed_tokens - computed_before == 5 * len(prompts)


def test_an_abort_frame_for_a_long_id_makes_decode_recompute_at_once(pair, reference_engine):
    decode, _ = pair
    rid = "abort-" + "z" * 194
    prompt = list(range(400, 440))
    want = expected(reference_engine, [prompt], 6)[0]
    layout = kv_layout_of(reference_engine)

    async def run() -> tuple[list[int], float]:
        async with grpc.aio.insecure_channel(decode.address) as ch:
            stream = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=greedy(6),
                remote_prefill=True))
            first = await stream.read()
            # A prefill worker whose transfer failed says so; here the test is that worker.
            with KVSenderPool(layout, "cpu", timeout_s=10.0, peer_id="test-prefill") as pool:
                pool.send_abort(first.reserved.kv_endpoint, transfer_key(rid)).result(20)
                sent = time.monotonic()
                tokens = await asyncio.wait_for(read_deltas(stream, []), 30)
            return tokens, time.monotonic() - sent

    tokens, seconds = asyncio.run(run())
    assert tokens == want
    assert seconds < 30  # not the 60 s of --kv-wait-timeout-s or the reservation TTL
    decode.wait_for(idle, what="idle after the abort")


def test_a_transfer_that_cannot_be_queued_fails_the_prefill_call(pair):
    decode, prefill = pair

    async def run() -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(decode.address) as dch, \
                grpc.aio.insecure_channel(prefill.address) as pch:
            stream = decode_pb2_grpc.DecodeStub(dch).Generate(decode_pb2.GenerateRequest(
                request_id="unqueued", prompt_token_ids=list(range(5, 40)), sampling=greedy(4),
                remote_prefill=True))
            first = await stream.read()
            # Two endpoints for a one-rank prefill worker: refused before anything is sent.
            endpoint = f"{first.reserved.kv_endpoint},{first.reserved.kv_endpoint}"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                    request_id="unqueued", prompt_token_ids=list(range(5, 40)),
                    sampling=greedy(4), decode_kv_endpoint=endpoint), timeout=30)
            stream.cancel()  # what a gateway does with the attempt: retry it elsewhere
            return err.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
    assert "tensor-parallel degree mismatch" in error.details()
    decode.wait_for(idle, what="decode idle")
    prefill.wait_for(idle, what="prefill idle")


def test_kv_that_never_comes_is_recomputed_after_the_reservation_ttl(tiny_llama_dir,
                                                                     reference_engine):
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64",
                          "--kv-reservation-ttl-s", "1", "--kv-wait-timeout-s", "60")
    try:
        prompt = list(range(600, 640))

        async def run() -> tuple[list[int], float]:
            async with grpc.aio.insecure_channel(decode.address) as ch:
                stream = decode_pb2_grpc.DecodeStub(ch).Generate(decode_pb2.GenerateRequest(
                    request_id="never-prefilled", prompt_token_ids=prompt, sampling=greedy(6),
                    remote_prefill=True))
                assert (await stream.read()).WhichOneof("kind") == "reserved"
                start = time.monotonic()
                tokens = await asyncio.wait_for(read_deltas(stream, []), 40)
                return tokens, time.monotonic() - start

        tokens, seconds = asyncio.run(run())
        assert tokens == expected(reference_engine, [prompt], 6)[0]
        assert seconds < 40  # the reservation's own bound, not --kv-wait-timeout-s
        decode.wait_for(idle, what="idle")
    finally:
        decode.kill()
