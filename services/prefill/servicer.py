"""splitserve.v1.Prefill over the engine in prefill role.

Runs on the gRPC event loop; the engine lives on its EngineLoop thread and KV sends on
kv_transfer's sender threads, so no handler ever blocks the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
from splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from engine.llm_engine import LLMEngine
from services.common import convert
from services.common.engine_loop import EngineLoop
from services.common.health import health_response

log = logging.getLogger(__name__)


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine_loop: EngineLoop, senders, model_name: str, worker) -> None:
        self.engine_loop = engine_loop
        self.senders = senders  # kv_transfer.KVSenderPool
        self.model_name = model_name
        self.worker = worker  # WorkerState: role, id, draining flag

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        if self.worker.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if request.model and request.model != self.model_name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model {request.model!r} is not served here (this worker serves {self.model_name!r})",
            )
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        try:
            params = convert.sampling_from_pb(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        def start(engine: LLMEngine):
            # Judge the request as the client sent it; then produce exactly one token here
            # (the decode worker makes the rest).
            engine.validate(rid, prompt, params)
            first_only = dataclasses.replace(params, max_tokens=1)
            engine.add_request(rid, prompt, first_only, priority=request.priority, hold_kv=True)

        try:
            stream, _ = await self.engine_loop.open(rid, start)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            out = await stream.get()
        except asyncio.CancelledError:
            # Cancelled while queued or running: it is never (or no further) computed.
            self.engine_loop.abort(rid)
            raise
        if out.error:
            await context.abort(grpc.StatusCode.INTERNAL, out.error)
        first = out.new_token_ids[0]
        kv_bytes = 0
        if request.decode_kv_endpoint and out.kv is not None:
            try:
                future = self.senders.send(
                    request.decode_kv_endpoint, rid, first, out.num_prompt_tokens, out.kv
                )
            except Exception as exc:  # queue full or bad endpoint: decode will recompute
                log.warning("KV transfer of %s not queued: %s", rid, exc)
            else:
                kv_bytes = out.kv.numel() * out.kv.element_size()
                future.add_done_callback(lambda f, rid=rid: _log_failed_send(rid, f))
        response = prefill_pb2.PrefillResponse(
            request_id=rid,
            first_token=convert.logprob_to_pb(first, out.new_logprobs[0] if out.new_logprobs else None),
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            kv_bytes=kv_bytes,
        )
        if out.prompt_logprobs is not None:
            response.prompt_logprobs.extend(
                convert.logprob_to_pb(t, lp) for t, lp in zip(prompt, out.prompt_logprobs)
            )
        return response

    async def Health(self, request, context) -> common_pb2.HealthResponse:
        return health_response(self.engine_loop, self.worker, kv_endpoint="")


def _log_failed_send(request_id: str, future) -> None:
    exc = future.exception()
    if exc is not None:
        log.warning("KV transfer of %s failed: %s", request_id, exc)
