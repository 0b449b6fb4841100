"""A load generator that routes as a registry-aware gateway would: every request reads the
Redis registry, reserves on the decode worker with the most free KV blocks, prefills on a
prefill worker, and retries once elsewhere if refused before its first token (a draining
worker answers UNAVAILABLE). Counts, per decode worker, the requests it completed."""

from __future__ import annotations

import asyncio
import collections
import itertools
from dataclasses import dataclass, field

import grpc
import redis.asyncio as aioredis
from splitserve.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

from services.common.registry import list_workers
from tests.services.flows import greedy, read_deltas

_ids = itertools.count()


@dataclass
class LoadStats:
    completed: collections.Counter = field(default_factory=collections.Counter)  # decode worker
    failures: list = field(default_factory=list)
    retries: int = 0


async def _pick(redis: aioredis.Redis, exclude: set[str]):
    workers = [w for w in await list_workers(redis) if not w.draining]
    decoders = [w for w in workers if w.role == "decode" and w.worker_id not in exclude]
    prefillers = [w for w in workers if w.role == "prefill"]
    if not decoders or not prefillers:
        return None, None
    decode = max(decoders, key=lambda w: (w.stats.get("kv_blocks_free", 0), -w.stats.get("running", 0)))
    return decode, prefillers[next(_ids) % len(prefillers)]


async def one_request(redis: aioredis.Redis, prompt: list[int], max_tokens: int,
                      stats: LoadStats) -> None:
    tried: set[str] = set()
    for _attempt in range(3):
        decode, prefill = await _pick(redis, tried)
        if decode is None:
            await asyncio.sleep(0.2)
            continue
        rid = f"load-{next(_ids)}"
        sampling = greedy(max_tokens)
        first_token = False
        try:
            async with grpc.aio.insecure_channel(decode.address) as dch, \
                    grpc.aio.insecure_channel(prefill.address) as pch:
                stream = decode_pb2_grpc.DecodeStub(dch).Generate(decode_pb2.GenerateRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                    remote_prefill=True))
                first = await stream.read()
                reply = await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
                    request_id=rid, prompt_token_ids=prompt, sampling=sampling,
                    decode_kv_endpoint=first.reserved.kv_endpoint))
                first_token = True
                tokens = await read_deltas(stream, [reply.first_token.token_id])
        except grpc.aio.AioRpcError as exc:
            retryable = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
            if exc.code() in retryable and not first_token:  # nothing streamed: retry elsewhere
                tried.add(decode.worker_id)
                stats.retries += 1
                continue
            stats.failures.append(f"{decode.worker_id}: {exc.code().name} {exc.details()}")
            return
        if len(tokens) != max_tokens:
            stats.failures.append(f"{decode.worker_id}: {len(tokens)} of {max_tokens} tokens")
        else:
            stats.completed[decode.worker_id] += 1
        return
    stats.failures.append("no worker accepted the request")


async def client(redis_url: str, stop: asyncio.Event, stats: LoadStats, max_tokens: int,
                 pause_s: float = 0.0, seed: int = 0) -> None:
    """Closed loop: one request at a time until `stop` is set."""
    redis = aioredis.from_url(redis_url)
    try:
        n = 0
        while not stop.is_set():
            prompt = [(seed * 131 + n * 17 + i) % 200 + 5 for i in range(24)]
            await one_request(redis, prompt, max_tokens, stats)
            n += 1
            if pause_s:
                await asyncio.sleep(pause_s)
    finally:
        await redis.aclose()
