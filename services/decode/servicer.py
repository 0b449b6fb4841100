"""splitserve.v1.Decode over the engine in decode role (or both roles, aggregated).

Runs on the gRPC event loop. KV arrives on kv_transfer receiver threads and is handed to
the engine thread through EngineLoop, which writes it into the reserved blocks between steps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status
from opentelemetry.trace import StatusCode as SpanStatus
from splitserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

from engine.kv_cache_manager import cdiv
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.remote_prefill import KVCacheFull
from services.common import convert, tracing
from services.common.engine_loop import EngineLoop
from services.common.health import WorkerState, health_response
from services.common.malformed import refuse_malformed
from services.decode.kv_keys import RemoteKVKeys
from services.decode.kv_room import KVRoom

log = logging.getLogger(__name__)
# The status detail of a stream the drain hands off; the gateway migrates such a stream.
DRAIN_HAND_OFF = "worker is draining: the stream is handed off to another worker"
_HAND_OFF = RequestOutput("", [], finished=False)  # put into a stream's queue by hand_off
_tracer = tracing.tracer("splitserve.decode")


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(
        self, engine_loop: EngineLoop, kv_endpoint: str, worker: WorkerState,
        kv_wait_timeout_s: float, kv_keys: RemoteKVKeys | None = None,
    ) -> None:
        self.engine_loop = engine_loop
        self.kv_endpoint = kv_endpoint
        self.worker = worker
        self.kv_wait_timeout_s = kv_wait_timeout_s
        # Shared with the worker's KV receiver callbacks, which map transfer keys back.
        self.kv_keys = kv_keys if kv_keys is not None else RemoteKVKeys()
        # A reservation the cache cannot hold now waits for room, up to as long as its KV may
        # take to come.
        self.kv_room = KVRoom(engine_loop, kv_wait_timeout_s)
        self._streams: dict[str, object] = {}  # open Generate streams (event loop only)

    async def Generate(self, request: decode_pb2.GenerateRequest, context):
        await refuse_malformed(request, context)
        # Started, not made current: this generator is resumed, and may be closed, from
        # different contexts (gRPC cancels or closes it at a yield), and a context attached in
        # one cannot be detached in another ("Failed to detach context" on every closed stream).
        # The phase spans name their parent explicitly (_record_phases).
        span = _tracer.start_span(
            "decode", context=tracing.context_from_grpc(context), kind=SpanKind.SERVER,
            attributes={"splitserve.request_id": request.request_id,
                        "splitserve.worker_id": self.worker.worker_id,
                        "splitserve.prompt_tokens": len(request.prompt_token_ids),
                        "splitserve.remote_prefill": request.remote_prefill},
        )
        try:
            # Closed explicitly: when this stream is cancelled or closed at a yield, the inner
            # generator's finally (which aborts the request) runs now, not whenever it is
            # garbage collected.
            async with aclosing(self._generate(request, context, span)) as messages:
                async for message in messages:
                    yield message
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(Status(SpanStatus.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            span.end()

    async def _generate(self, request, context, span):
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
        resumed = list(request.resumed_output_token_ids)
        if resumed and remote:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a resumed request (resumed_output_token_ids) is recomputed here; "
                "remote_prefill must be false")
        if resumed:
            span.set_attribute("splitserve.resumed_output_tokens", len(resumed))

        def start(engine: LLMEngine):
            if remote:
                return engine.remote.reserve(rid, prompt, params, priority=request.priority,
                                             cache_salt=request.cache_salt,
                                             reuse_cached_prefix=request.reuse_cached_prefix)
            engine.add_request(rid, prompt, params, priority=request.priority,
                               cache_salt=request.cache_salt, resumed_output_token_ids=resumed)
            return None

        try:
            if remote:
                stream, reservation = await self.kv_room.open(
                    rid, start, cdiv(len(prompt), self.engine_loop.engine.config.block_size),
                    give_up=lambda: self.worker.draining)
            else:
                stream, reservation = await self.engine_loop.open(rid, start)
        except KVCacheFull as exc:
            if self.worker.draining:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV cache full: {exc}")
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        timer = None
        finished = False
        reserved_ns = time.time_ns()
        first_delta = True
        self._streams[rid] = stream
        try:
            if remote:
                # The KV to come is the prompt's after the prefix this worker holds already.
                held = reservation.num_cached_tokens
                num_blocks = len(reservation.block_ids)
                span.set_attribute("splitserve.kv_reused_tokens", held)
                self.kv_keys.add(rid, num_tokens=len(prompt) - held, num_blocks=num_blocks)
                yield decode_pb2.GenerateResponse(reserved=decode_pb2.Reserved(
                    kv_endpoint=self.kv_endpoint, num_blocks=num_blocks, num_cached_tokens=held))
                timer = asyncio.get_running_loop().call_later(
                    self.kv_wait_timeout_s, self._kv_timed_out, rid
                )
            while not finished:
                # Whatever queued while the last message was written goes out as one message:
                # a handler slower per message than the engine per step never falls behind.
                outs = [await stream.get(), *stream.get_ready()]
                handed_off = any(out is _HAND_OFF for out in outs)
                if handed_off:
                    outs = [out for out in outs if out is not _HAND_OFF]
                if handed_off and not outs:
                    break
                if timer is not None:
                    timer.cancel()
                    timer = None
                if first_delta:
                    first_delta = False
                    _record_phases(span, remote, reserved_ns, outs[0].kv_arrived_ns)
                for run in _contiguous_runs(outs):
                    out = run[-1]
                    finished = out.finished
                    if finished:
                        span.set_attribute("splitserve.output_tokens", out.num_output_tokens)
                        span.set_attribute("splitserve.finish_reason", out.finish_reason or "")
                        span.set_attribute("splitserve.cached_prefix_tokens",
                                           out.num_cached_tokens)
                    yield decode_pb2.GenerateResponse(delta=_delta(run, prompt))
                if handed_off:
                    break
            if not finished:  # handed off: what was queued went out first
                span.add_event("handed_off")
                await context.abort(grpc.StatusCode.UNAVAILABLE, DRAIN_HAND_OFF)
        finally:
            self._streams.pop(rid, None)
            if timer is not None:
                timer.cancel()
            if remote:
                self.kv_keys.discard(rid)
            if not finished:  # the caller went away or cancelled: free the blocks now
                self.engine_loop.abort(rid)

    @property
    def num_open_streams(self) -> int:
        return len(self._streams)

    def hand_off(self) -> int:
        """Drain deadline: end every open stream with UNAVAILABLE (DRAIN_HAND_OFF), which the
        gateway answers by migrating the request. Returns how many streams there were."""
        for stream in self._streams.values():
            stream.queue.put_nowait(_HAND_OFF)
        return len(self._streams)

    def _kv_timed_out(self, request_id: str) -> None:
        log.warning("KV for %s did not arrive in %.1fs; recomputing locally",
                    request_id, self.kv_wait_timeout_s)
        self.engine_loop.submit(lambda engine: engine.remote.recompute_locally(request_id))

    async def Health(self, request, context) -> common_pb2.HealthResponse:
        await refuse_malformed(request, context)
        return health_response(self.engine_loop, self.worker, self.kv_endpoint)


def _record_phases(span, remote: bool, reserved_ns: int, kv_arrived_ns: int | None) -> None:
    """Child spans: waiting for remote KV, then the first decode step."""
    if not span.is_recording():
        return
    parent = trace.set_span_in_context(span)
    first_step_start = reserved_ns
    if remote and kv_arrived_ns is not None:
        _tracer.start_span("decode.kv_wait", context=parent, start_time=reserved_ns).end(
            end_time=kv_arrived_ns)
        first_step_start = kv_arrived_ns
    _tracer.start_span("decode.first_step", context=parent, start_time=first_step_start).end()


def _contiguous_runs(outs: list[RequestOutput]) -> list[list[RequestOutput]]:
    """Consecutive outputs whose tokens follow on from each other, to merge into one delta."""
    runs: list[list[RequestOutput]] = []
    for out in outs:
        if runs and _start(out) == runs[-1][-1].num_output_tokens and out.prompt_logprobs is None:
            runs[-1].append(out)
        else:
            runs.append([out])
    return runs


def _start(out: RequestOutput) -> int:
    return out.num_output_tokens - len(out.new_token_ids)


def _delta(run: list[RequestOutput], prompt: list[int]) -> decode_pb2.TokenDelta:
    """One TokenDelta for a run of outputs (see _contiguous_runs); only the last may finish."""
    first, last = run[0], run[-1]
    delta = decode_pb2.TokenDelta(
        token_ids=[t for out in run for t in out.new_token_ids],
        output_index=_start(first),
        finish_reason=convert.FINISH_REASONS.get(last.finish_reason, common_pb2.FINISH_REASON_ERROR),
    )
    for out in run:
        if out.new_logprobs:
            delta.logprobs.extend(
                convert.logprob_to_pb(t, lp)
                for t, lp in zip(out.new_token_ids, out.new_logprobs, strict=False)
            )
    if last.compute is not None:
        delta.compute_seconds.CopyFrom(convert.compute_to_pb(last.compute))
    if first.prompt_logprobs is not None:
        delta.prompt_logprobs.extend(
            convert.logprob_to_pb(t, lp) for t, lp in zip(prompt, first.prompt_logprobs, strict=False)
        )
    if last.finished:
        delta.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=last.num_prompt_tokens,
                completion_tokens=last.num_output_tokens,
                cached_tokens=last.num_cached_tokens,
                compute_seconds=convert.compute_to_pb(last.compute),
            )
        )
        if last.error:
            delta.finish_reason = common_pb2.FINISH_REASON_ERROR
    return delta
