"""Reading one Decode.Generate stream for the dispatcher: its TokenDeltas as TokenEvents, less
the tokens the caller already has, each with what the worker charged since the last; an RPC
failure as AttemptFailed naming the worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from engine.outputs import ComputeSeconds, Logprobs
from services.common import convert
from services.gateway.routing.worker_pool import WorkerEndpoint


@dataclass(frozen=True)
class TokenEvent:
    """New output tokens of one request, in order, without repeats."""

    token_ids: tuple[int, ...] = ()
    logprobs: tuple[Logprobs, ...] = ()  # one per token when logprobs were asked
    finish_reason: str | None = None  # "stop", "length", "error"
    # Index i is the logprob of prompt token i (None for the first); first event only.
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    error_code: str | None = None  # with finish_reason "error": dispatcher.NO_WORKER, or None
    # Engine time a worker charged to the request since the last event (the prefill
    # response's, or what a decode worker's running total grew by).
    compute: ComputeSeconds | None = None


@dataclass
class AttemptFailed(Exception):
    """An RPC of one attempt failed; `endpoint` is the worker whose call failed."""

    endpoint: WorkerEndpoint
    error: grpc.aio.AioRpcError


async def decode_events(call, decode: WorkerEndpoint, have: tuple[int, ...],
                         pending: asyncio.Future | None = None,
                         resumed: bool = False) -> AsyncIterator[TokenEvent]:
    """TokenDeltas of a Decode.Generate stream, minus the tokens the caller already has
    (`have`: the prefill worker's first token, or those a migrated stream resumes after).
    Those the stream repeats must be the same: a decode worker that recomputed the prompt
    itself (its KV never came) samples its own first token, and on another CPU or batch that
    can differ from the one the client got, and the tokens after it follow it. The attempt
    then fails (FAILED_PRECONDITION, not the worker's health) and the request moves with the
    tokens sent so far. `pending` is a read already started on the stream; its message comes
    first. A `resumed` (migrated) stream reports no cached tokens: usage keeps the first
    attempt's. Each event's `compute` is what the worker charged since the last one."""
    seen = list(have)  # every token the caller has, this attempt's included
    healthy = False
    charged = ComputeSeconds()  # the worker's running total at the last message
    while True:
        if pending is not None:
            message, pending = await pending, None
        else:
            message = await read_message(call, decode)
        if message is None:
            raise AttemptFailed(decode, synthetic_error("decode stream ended before finishing"))
        if not message.HasField("delta"):
            continue
        if not healthy:
            healthy = True
            decode.breaker.record_success()
        delta = message.delta
        skip = max(0, len(seen) - delta.output_index)
        repeated = list(delta.token_ids[:skip])
        if repeated != seen[delta.output_index:delta.output_index + len(repeated)]:
            raise AttemptFailed(decode, synthetic_error(
                f"the decode stream's tokens from index {delta.output_index} "
                f"({repeated[:4]}) differ from those already sent "
                f"({seen[delta.output_index:delta.output_index + 4]})",
                grpc.StatusCode.FAILED_PRECONDITION))
        token_ids = tuple(delta.token_ids[skip:])
        seen.extend(token_ids)
        compute = None
        running = (delta.compute_seconds if delta.HasField("compute_seconds")
                   else delta.usage.compute_seconds if delta.HasField("usage") else None)
        if running is not None:
            running = convert.compute_from_pb(running)
            compute, charged = running.since(charged), running
        finish = convert.FINISH_REASON_NAMES.get(delta.finish_reason, "error")
        if finish == "abort":
            finish = "error"
        yield TokenEvent(
            token_ids=token_ids,
            logprobs=tuple(convert.logprob_from_pb(lp) for lp in delta.logprobs[skip:]),
            finish_reason=finish,
            prompt_logprobs=prompt_logprobs(delta.prompt_logprobs),
            num_cached_tokens=(delta.usage.cached_tokens
                               if delta.HasField("usage") and not resumed else 0),
            error="the worker failed" if finish == "error" else None,
            compute=compute,
        )
        if finish is not None:
            return


async def read_message(call, endpoint: WorkerEndpoint):
    try:
        message = await call.read()
    except grpc.aio.AioRpcError as exc:
        raise AttemptFailed(endpoint, exc) from None
    return None if message is grpc.aio.EOF else message


def prompt_logprobs(pbs) -> tuple[Logprobs | None, ...] | None:
    if not pbs:
        return None
    return (None,) + tuple(convert.logprob_from_pb(lp) for lp in pbs[1:])


def synthetic_error(details: str,
                     code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
