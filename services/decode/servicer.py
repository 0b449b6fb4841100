"""splitserve.v1.Decode over the engine in decode role (or both roles, aggregated).

Runs on the gRPC event loop. KV arrives on kv_transfer receiver threads and is handed to
the engine thread through EngineLoop, which writes it into the reserved blocks between steps.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from engine.llm_engine import KVCacheFull, LLMEngine
from engine.outputs import RequestOutput
from services.common import convert
from services.common.engine_loop import EngineLoop
from services.common.health import WorkerState, health_response

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self, engine_loop: EngineLoop, kv_endpoint: str, worker: WorkerState,
        kv_wait_timeout_s: float,
    ) -> None:
        self.engine_loop = engine_loop
        self.kv_endpoint = kv_endpoint
        self.worker = worker
        self.kv_wait_timeout_s = kv_wait_timeout_s

    async def Generate(self, request: decode_pb2.GenerateRequest, context):
        if self.worker.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
        if request.model and request.model != self.worker.model_name:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"model {request.model!r} is not served here (this worker serves "
                f"{self.worker.model_name!r})",
            )
        rid = request.request_id
        prompt = list(request.prompt_token_ids)
        try:
            params = convert.sampling_from_pb(request.sampling)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        remote = request.remote_prefill
        if remote and not self.kv_endpoint:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker takes no remote KV")

        def start(engine: LLMEngine):
            if remote:
                return engine.reserve_remote(rid, prompt, params, priority=request.priority)
            engine.add_request(rid, prompt, params, priority=request.priority)
            return None

        try:
            stream, block_ids = await self.engine_loop.open(rid, start)
        except KVCacheFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV cache full: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        timer = None
        finished = False
        try:
            if remote:
                yield decode_pb2.GenerateResponse(
                    reserved=decode_pb2.Reserved(kv_endpoint=self.kv_endpoint, num_blocks=len(block_ids))
                )
                timer = asyncio.get_running_loop().call_later(
                    self.kv_wait_timeout_s, self._kv_timed_out, rid
                )
            while not finished:
                out = await stream.get()
                if timer is not None:
                    timer.cancel()
                    timer = None
                finished = out.finished
                yield decode_pb2.GenerateResponse(delta=_delta(out, prompt))
        finally:
            if timer is not None:
                timer.cancel()
            if not finished:  # the caller went away or cancelled: free the blocks now
                self.engine_loop.abort(rid)

    def _kv_timed_out(self, request_id: str) -> None:
        log.warning("KV for %s did not arrive in %.1fs; recomputing locally",
                    request_id, self.kv_wait_timeout_s)
        self.engine_loop.submit(lambda engine: engine.recompute_locally(request_id))

    async def Health(self, request, context) -> common_pb2.HealthResponse:
        return health_response(self.engine_loop, self.worker, self.kv_endpoint)


def _delta(out: RequestOutput, prompt: list[int]) -> decode_pb2.TokenDelta:
    delta = decode_pb2.TokenDelta(
        token_ids=out.new_token_ids,
        output_index=out.num_output_tokens - len(out.new_token_ids),
        finish_reason=convert.FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_ERROR),
    )
    if out.new_logprobs:
        delta.logprobs.extend(
            convert.logprob_to_pb(t, lp) for t, lp in zip(out.new_token_ids, out.new_logprobs)
        )
    if out.prompt_logprobs is not None:
        delta.prompt_logprobs.extend(
            convert.logprob_to_pb(t, lp) for t, lp in zip(prompt, out.prompt_logprobs)
        )
    if out.finished:
        delta.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=out.num_cached_tokens,
            )
        )
        if out.error:
            delta.finish_reason = common_pb2.FINISH_REASON_ERROR
    return delta

