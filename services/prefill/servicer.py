"""splitserve.v1.Prefill over the engine in prefill role.

Runs on the gRPC event loop; the engine lives on its EngineLoop thread and KV sends on
kv_transfer's sender threads, so no handler ever blocks the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from splitserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc

from engine.llm_engine import LLMEngine
from kv_transfer import KVQueueFullError, KVSenderLimitError
from services.common import convert, tracing
from services.common.engine_loop import EngineLoop
from services.common.health import health_response
from services.common.malformed import refuse_malformed
from services.prefill.kv_endpoints import KVEndpointPolicy, KVEndpointRefused
from services.prefill.kv_handoff import KVHandoff

log = logging.getLogger(__name__)
_tracer = tracing.tracer("splitserve.prefill")

# How long a computed prompt's KV waits for room behind the transfers already queued to its
# decode worker (--max-queued-kv-transfers) before the call is refused.
QUEUE_ROOM_WAIT_S = 10.0


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, engine_loop: EngineLoop, senders, model_name: str, worker,
                 kv_endpoints: KVEndpointPolicy | None = None) -> None:
        self.engine_loop = engine_loop
        self.senders = senders  # kv_transfer.KVSenderPool
        self.kv_handoff = KVHandoff(senders)
        # Where decode_kv_endpoint may point (default: loopback only).
        self.kv_endpoints = kv_endpoints if kv_endpoints is not None else KVEndpointPolicy()
        self.model_name = model_name
        self.worker = worker  # WorkerState: role, id, draining flag

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context) -> prefill_pb2.PrefillResponse:
        await refuse_malformed(request, context)
        with _tracer.start_as_current_span(
            "prefill", context=tracing.context_from_grpc(context), kind=SpanKind.SERVER,
            attributes={"splitserve.request_id": request.request_id,
                        "splitserve.worker_id": self.worker.worker_id,
                        "splitserve.prompt_tokens": len(request.prompt_token_ids)},
        ) as span:
            return await self._prefill(request, context, span)

    async def _send_when_queued(self, endpoint, rid, first, num_sent, kv, send_span) -> None:
        """Queue the KV transfer, waiting up to QUEUE_ROOM_WAIT_S for room when the decode
        worker's queue is full: a burst of more prompts than it holds (104 at once in the
        structured-output tests) has its KV computed already, and a refusal threw that away,
        made the gateway retry from scratch and, counted as failures, opened this worker's
        circuit. The queue drains as fast as the channel sends."""
        deadline = asyncio.get_running_loop().time() + QUEUE_ROOM_WAIT_S
        delay = 0.002
        while True:
            try:
                self.kv_handoff.send(endpoint, rid, first, num_sent, kv,
                                     on_done=lambda error, s=send_span: self._sent(s, kv, error))
                return
            except KVQueueFullError:
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:  # the caller left: the KV is dropped, never queued
                send_span.end()
                raise
            delay = min(2 * delay, 0.05)

    def _sent(self, span, kv, error: BaseException | None) -> None:
        """Sender thread, once the transfer has settled: nothing reads `kv` any more."""
        _finish_send(span, error)
        self.engine_loop.handoffs.settled(kv)
        self.engine_loop.engine.release_kv(kv)

    async def _prefill(self, request, context, span) -> prefill_pb2.PrefillResponse:
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
        if request.decode_kv_endpoint:
            # Before any compute: an endpoint this worker will not push to fails the call now.
            try:
                await self.kv_endpoints.check(request.decode_kv_endpoint)
            except KVEndpointRefused as exc:
                log.warning("Prefill %.80s refused: %s", rid, exc)
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        def start(engine: LLMEngine):
            # Judge the request as the client sent it; then produce exactly one token here
            # (the decode worker makes the rest).
            engine.validate(rid, prompt, params)
            first_only = dataclasses.replace(params, max_tokens=1)
            engine.add_request(rid, prompt, first_only, priority=request.priority, hold_kv=True,
                               cache_salt=request.cache_salt,
                               kv_reused_tokens=request.decode_cached_tokens)

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
        _record_phases(span, out.first_scheduled_ns)
        span.set_attribute("splitserve.cached_prefix_tokens", out.num_cached_tokens)
        kv_bytes = 0
        if out.kv is not None and not request.decode_kv_endpoint:
            self.engine_loop.handoffs.settled(out.kv)  # nowhere to send it
        if request.decode_kv_endpoint and out.kv is not None:
            endpoint = request.decode_kv_endpoint
            kv_bytes = out.kv.numel() * out.kv.element_size()
            send_span = _tracer.start_span(
                "prefill.kv_send", attributes={"splitserve.transfer_bytes": kv_bytes,
                                               "splitserve.decode_kv_endpoint": endpoint})
            # Only the prompt's tokens after those the decode worker holds travel.
            num_sent = out.num_prompt_tokens - request.decode_cached_tokens
            span.set_attribute("splitserve.kv_reused_tokens", request.decode_cached_tokens)
            try:
                await self._send_when_queued(endpoint, rid, first, num_sent, out.kv, send_span)
            except asyncio.CancelledError:
                self.engine_loop.handoffs.settled(out.kv)  # never queued: none to wait for
                raise
            except Exception as exc:
                self.engine_loop.handoffs.settled(out.kv)
                # Not even queued (no room in time, unusable endpoint): fail the call, so the
                # caller retries elsewhere and drops the decode stream rather than wait for
                # this KV. Limits reached are load, not ill health (the gateway's breaker).
                send_span.set_status(Status(StatusCode.ERROR, str(exc)))
                send_span.end()
                log.warning("KV transfer of %.80s not queued: %s", rid, exc)
                code = (grpc.StatusCode.RESOURCE_EXHAUSTED
                        if isinstance(exc, KVSenderLimitError | KVQueueFullError)
                        else grpc.StatusCode.UNAVAILABLE)
                await context.abort(code, f"KV transfer to {endpoint[:200]} not possible: {exc}")
            span.set_attribute("splitserve.transfer_bytes", kv_bytes)
        response = prefill_pb2.PrefillResponse(
            request_id=rid,
            first_token=convert.logprob_to_pb(first, out.new_logprobs[0] if out.new_logprobs else None),
            num_prompt_tokens=out.num_prompt_tokens,
            num_cached_tokens=out.num_cached_tokens,
            kv_bytes=kv_bytes,
            compute_seconds=convert.compute_to_pb(out.compute),
            first_token_stops=out.finish_reason == "stop",
        )
        if out.prompt_logprobs is not None:
            response.prompt_logprobs.extend(
                convert.logprob_to_pb(t, lp) for t, lp in zip(prompt, out.prompt_logprobs, strict=False)
            )
        return response

    async def Health(self, request, context) -> common_pb2.HealthResponse:
        await refuse_malformed(request, context)
        return health_response(self.engine_loop, self.worker, kv_endpoint="")


def _finish_send(span, error: BaseException | None) -> None:
    # Runs on the kv_transfer sender thread; KVHandoff logs the failure and sends the abort.
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def _record_phases(span, first_scheduled_ns: int | None) -> None:
    """Child spans for the time queued and the time computing, from engine milestones."""
    start = getattr(span, "start_time", None)
    if not span.is_recording() or start is None or first_scheduled_ns is None:
        return
    parent = trace.set_span_in_context(span)
    _tracer.start_span("prefill.queue", context=parent, start_time=start).end(
        end_time=max(first_scheduled_ns, start))
    _tracer.start_span("prefill.forward", context=parent,
                       start_time=max(first_scheduled_ns, start)).end()
