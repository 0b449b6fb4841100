"""The request flows a gateway drives, written out plainly for worker-level tests."""

from __future__ import annotations

import grpc
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc


def greedy(max_tokens: int, **kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, has_temperature=True, ignore_eos=True, seed=7, **kw
    )


async def disaggregated(decode_addr: str, prefill_addr: str, rid: str, prompt: list[int],
                        sampling: common_pb2.SamplingParams) -> list[int]:
    """Reserve on decode, prefill elsewhere, read the rest from decode; returns all tokens."""
    tokens, _, _ = await disaggregated_reusing(decode_addr, prefill_addr, rid, prompt, sampling,
                                               reuse=False)
    return tokens


async def disaggregated_reusing(
    decode_addr: str, prefill_addr: str, rid: str, prompt: list[int],
    sampling: common_pb2.SamplingParams, reuse: bool = True, tell_prefill: bool = True,
) -> tuple[list[int], decode_pb2.Reserved, prefill_pb2.PrefillResponse]:
    """The gateway's flow with the decode worker's cached prefix reused (`reuse`) and the
    prefill worker told to skip it (`tell_prefill`; False plays a prefill worker from before
    decode_cached_tokens). Returns all tokens, the reservation and the prefill's reply."""
    async with grpc.aio.insecure_channel(decode_addr) as dch, \
            grpc.aio.insecure_channel(prefill_addr) as pch:
        stream = decode_pb2_grpc.DecodeStub(dch).Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling, remote_prefill=True,
            reuse_cached_prefix=reuse))
        first = await stream.read()
        assert first.WhichOneof("kind") == "reserved"
        response = await prefill_pb2_grpc.PrefillStub(pch).Prefill(prefill_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling,
            decode_kv_endpoint=first.reserved.kv_endpoint,
            decode_cached_tokens=first.reserved.num_cached_tokens if tell_prefill else 0))
        tokens = [response.first_token.token_id]
        return await read_deltas(stream, tokens), first.reserved, response


async def read_deltas(stream, tokens: list[int]) -> list[int]:
    """Append deltas, skipping positions already held (a local recompute restarts at 0)."""
    while (message := await stream.read()) is not grpc.aio.EOF:
        delta = message.delta
        for i, token in enumerate(delta.token_ids):
            index = delta.output_index + i
            if index < len(tokens):
                assert tokens[index] == token, "a recompute changed an already-sent token"
            else:
                tokens.append(token)
    return tokens


async def aggregated(decode_addr: str, rid: str, prompt: list[int],
                     sampling: common_pb2.SamplingParams) -> list[int]:
    async with grpc.aio.insecure_channel(decode_addr) as dch:
        stream = decode_pb2_grpc.DecodeStub(dch).Generate(decode_pb2.GenerateRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling))
        return await read_deltas(stream, [])
