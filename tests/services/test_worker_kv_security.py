"""Real worker processes against a hostile KV plane: a forged KV frame (first token outside the
vocabulary, wrong block count, an oversized payload) fails only its request, which recomputes
locally with the same output, while the decode worker stays up and counts the refusals; a
prefill worker pushes KV only to registered or allowed endpoints through a bounded sender
pool; with a cluster secret, KV channels need it on both ends."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from engine.sampling_params import SamplingParams
from kv_transfer import KVHeader
from services.common.server import kv_layout_of
from splitserve_cli.processes import free_port, start_worker
from tests.kv_transfer.kv_harness import wait_until
from tests.kv_transfer.kv_raw_peer import RawPeer, forged_frame
from tests.metrics_text import scrape_worker as scrape
from tests.services.flows import disaggregated, greedy, read_deltas

pytestmark = pytest.mark.timeout(240)

PROMPT = [5 + i for i in range(20)]  # 2 blocks of 16
REFUSED = 'splitserve_kv_frames_refused_total{role="decode"}'


def expected(reference_engine, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, seed=7)
    return reference_engine.generate([prompt], params)[0].token_ids


async def forge_and_read(decode, layout, rid: str, forge) -> list[int]:
    """Reserve on the decode worker, push it a forged frame by hand, read the whole stream."""
    async with grpc.aio.insecure_channel(decode.address) as channel:
        stream = decode_pb2_grpc.DecodeStub(channel).Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=PROMPT, sampling=greedy(6), remote_prefill=True))
        first = await stream.read()
        assert first.WhichOneof("kind") == "reserved" and first.reserved.num_blocks == 2
        peer = RawPeer(first.reserved.kv_endpoint, layout, timeout_s=10.0, peer_id=f"forger-{rid}")
        try:
            assert (await asyncio.to_thread(peer.hello))["ok"]
            await asyncio.to_thread(peer.open_channel)
            await asyncio.to_thread(forge, peer)
            return await read_deltas(stream, [])
        finally:
            peer.close()


def test_forged_kv_frames_fail_only_their_request_and_the_decode_worker_survives(
        tiny_llama_dir, reference_engine):
    layout = kv_layout_of(reference_engine)
    vocab = reference_engine.model_config.vocab_size
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64")
    try:
        forgeries = {
            # Appended unchecked, this token made the next engine step raise: the process died.
            "bad-first-token": lambda p: p.send_kv("bad-first-token", 20, 2, vocab + 5),
            "wrong-num-blocks": lambda p: p.send_kv("wrong-num-blocks", 20, 3, 1),
            "wrong-num-tokens": lambda p: p.send_kv("wrong-num-tokens", 17, 2, 1),
        }
        for rid, forge in forgeries.items():
            tokens = asyncio.run(forge_and_read(decode, layout, rid, forge))
            assert tokens == expected(reference_engine, PROMPT, 6), rid  # recomputed locally
        assert decode.process.poll() is None
        metrics = scrape(decode)
        assert metrics[REFUSED] == len(forgeries)
        assert metrics['splitserve_kv_transfers_total{role="decode"}'] == 0
        decode.wait_for(lambda h: h.stats.kv_blocks_free == h.stats.kv_blocks_total, what="idle")
    finally:
        decode.kill()


def test_an_oversized_frame_closes_its_channel_before_any_allocation(tiny_llama_dir,
                                                                     reference_engine):
    layout = kv_layout_of(reference_engine)
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64")
    try:
        def huge(peer: RawPeer) -> None:
            peer.ring(forged_frame(KVHeader("huge", 20, 2, 1, layout), num_blocks=2**40))

        tokens = asyncio.run(forge_and_read(decode, layout, "huge", huge))
        assert tokens == expected(reference_engine, PROMPT, 6)
        assert scrape(decode)[REFUSED] == 1 and decode.process.poll() is None
    finally:
        decode.kill()


def prefill_call(address: str, endpoint: str, rid: str):
    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            return await prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=PROMPT, sampling=greedy(4),
                decode_kv_endpoint=endpoint), timeout=30)
    return asyncio.run(call())


def status_of(address: str, endpoint: str, rid: str) -> grpc.StatusCode:
    try:
        prefill_call(address, endpoint, rid)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_prefill_pushes_kv_only_to_allowed_endpoints_through_a_bounded_pool(tiny_llama_dir):
    prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64",
                           "--max-kv-senders", "2", "--kv-transfer-timeout-s", "60")
    try:
        # Not a decode worker anyone registered, not loopback: refused before any compute.
        assert status_of(prefill.address, "10.9.8.7:4000", "far") == grpc.StatusCode.PERMISSION_DENIED
        assert status_of(prefill.address, "not an endpoint", "junk") == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert prefill.health().stats.computed_tokens == 0
        # Loopback is allowed without a registry; nothing listens there, so each sender stays
        # connecting and holds its slot.
        ports = [free_port() for _ in range(3)]
        assert status_of(prefill.address, f"127.0.0.1:{ports[0]}", "a") == grpc.StatusCode.OK
        assert status_of(prefill.address, f"127.0.0.1:{ports[1]}", "b") == grpc.StatusCode.OK
        assert status_of(prefill.address, f"127.0.0.1:{ports[2]}", "c") == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        assert status_of(prefill.address, "", "no-kv") == grpc.StatusCode.OK
        assert prefill.process.poll() is None
    finally:
        prefill.kill()


def test_with_a_registry_only_registered_decode_endpoints_are_accepted(
        tiny_llama_dir, reference_engine, redis_server):
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64",
                          "--redis-url", redis_server, "--heartbeat-ttl-s", "2")
    prefill = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64",
                           "--redis-url", redis_server)
    try:
        client = redis.Redis.from_url(redis_server)
        wait_until(lambda: client.keys("splitserve:worker:decode*"), what="decode registered")
        tokens = asyncio.run(disaggregated(decode.address, prefill.address, "registered",
                                           PROMPT, greedy(6)))
        assert tokens == expected(reference_engine, PROMPT, 6)
        assert scrape(decode)['splitserve_kv_transfers_total{role="decode"}'] == 1
        # Loopback is no longer enough once there is a registry.
        assert status_of(prefill.address, f"127.0.0.1:{free_port()}", "stray") == \
            grpc.StatusCode.PERMISSION_DENIED
    finally:
        decode.kill()
        prefill.kill()


def test_kv_channels_need_the_cluster_secret_on_both_ends(tiny_llama_dir, reference_engine,
                                                          tmp_path):
    secret = tmp_path / "cluster-secret"
    secret.write_text("s3cret-s3cret-s3cret-0123456789\n")
    decode = start_worker("decode", tiny_llama_dir, "--num-kv-blocks", "64",
                          "--cluster-secret-file", str(secret), "--kv-wait-timeout-s", "3")
    good = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64",
                        "--cluster-secret-file", str(secret))
    rogue = start_worker("prefill", tiny_llama_dir, "--num-kv-blocks", "64")
    try:
        want = expected(reference_engine, PROMPT, 6)
        assert asyncio.run(disaggregated(decode.address, good.address, "with-secret", PROMPT,
                                         greedy(6))) == want
        assert scrape(decode)['splitserve_kv_transfers_total{role="decode"}'] == 1
        # The rogue prefill worker's channel is refused; the request recomputes on decode.
        assert asyncio.run(disaggregated(decode.address, rogue.address, "without-secret",
                                         PROMPT, greedy(6))) == want
        metrics = scrape(decode)
        # Its channel, and the fresh one its ABORT tried after that.
        assert metrics['splitserve_kv_auth_failures_total{role="decode"}'] >= 1
        assert metrics['splitserve_kv_transfers_total{role="decode"}'] == 1
    finally:
        for worker in (decode, good, rogue):
            worker.kill()
