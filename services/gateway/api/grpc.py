"""splitserve.v1.Gateway: the gRPC front door. Same path as HTTP (limits, admission,
preprocessing, deadlines, dispatcher, stop strings) with protobuf in and out; runs on the
gateway's event loop (tokenizing in its tokenizer threads)."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from services.common import convert, tracing
from services.common.malformed import add_servicer, refuse_malformed
from services.gateway.api.client_address import grpc_peer_host
from services.gateway.api.deadline import RequestDeadline
from services.gateway.api.request_ids import gateway_request_id, worker_request_id
from services.gateway.api.text_stream import TextDelta
from services.gateway.errors import APIError
from services.gateway.gateway import Gateway
from services.gateway.request_record import RequestRecord

log = logging.getLogger(__name__)


# A call cancelled this close to its deadline ran out of time: the caller's clock runs ahead of
# the gateway's by the time its cancellation takes to arrive (8 of 9 such calls in one audit run
# were counted as disconnects with `remaining <= 0`).
_DEADLINE_SLACK_S = 0.5


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(self, request: gateway_pb2.GenerateTextRequest, context):
        await refuse_malformed(request, context)
        try:
            request_id = gateway_request_id(request.request_id,
                                            self.gateway.config.max_request_id_length,
                                            "request_id")
            bad_id = None
        except APIError as exc:  # refused below, under an id of its own
            request_id, bad_id = uuid.uuid4().hex, exc
        record = self.gateway.observer.begin("grpc", request_id,
                                             tracing.context_from_grpc(context),
                                             "/splitserve.v1.Gateway/Generate")
        record.client = self.gateway.clients.client(
            grpc_peer_host(context.peer()),
            [v for k, v in context.invocation_metadata() or () if k == "x-forwarded-for"])
        try:
            await self._generate(request, context, record, bad_id)
        except asyncio.CancelledError:  # the caller cancelled, went away or ran out of time
            remaining = context.time_remaining()
            if remaining is not None and remaining <= _DEADLINE_SLACK_S:  # its own: a timeout
                record.finish(grpc.StatusCode.DEADLINE_EXCEEDED.name, APIError.timed_out(
                    "the call's deadline passed"))
            else:
                record.client_gone(grpc.StatusCode.CANCELLED.name)
            raise
        except BaseException as exc:  # an abort was recorded before it was raised
            record.finish(grpc.StatusCode.UNKNOWN.name, exc)
            raise
        record.finish(grpc.StatusCode.OK.name)

    async def _generate(self, request, context, record: RequestRecord,
                        bad_id: APIError | None) -> None:
        gateway = self.gateway
        # The id the gateway logs and traces the call under, as HTTP's x-request-id header.
        await context.send_initial_metadata((("x-request-id", record.request_id),))
        try:
            # Who is asking first: an unauthenticated caller learns nothing of the rest.
            tenant = gateway.admission.authenticate(_authorization(request, context))
            record.authenticated(tenant.name)
            share = gateway.admission.share_of(tenant, record.client)
            if bad_id is not None:
                raise bad_id
            if request.model:
                gateway.check_model(request.model)
            deadline = RequestDeadline.for_grpc(gateway.config, context, record.arrival,
                                                gateway.cutoff)
            with gateway.admission.preparing(tenant, share):
                spec = await deadline.within(gateway.off_loop(
                    request.ByteSize(), self._spec, request,
                    worker_request_id(record.request_id), gateway.limits()), "tokenizing")
            record.prompt(len(spec.prompt_token_ids),
                          lambda: gateway.tokenizer.decode(spec.prompt_token_ids))
            # Waits in the fair queue; a cancelled call gives its place up.
            ticket = await deadline.within(
                gateway.admission.admit(tenant, [spec], len(spec.prompt_token_ids), share),
                "queued")
        except APIError as exc:
            await _abort(context, record, exc)
        spec = ticket.specs[0]  # max_tokens within the tenant's limit
        (stream,) = gateway.choice_streams(ticket, record, deadline)
        timeout = gateway.config.slow_client_timeout_s
        try:
            try:
                first = await anext(stream)
            except APIError as exc:  # before any output: the status code says what failed
                await _abort(context, record, exc)
            delta: TextDelta | None = first
            while delta is not None:
                if delta.error_code == "request_timeout" and deadline.callers:
                    # The caller's own deadline: its library reports DEADLINE_EXCEEDED
                    # whichever side's timer fires first, so the status says it too (no
                    # replay to fear: the call has no time left to retry in).
                    await _abort(context, record, APIError.timed_out(delta.error))
                try:
                    # A caller that stops reading stalls this write (HTTP/2 flow control).
                    # asyncio.timeout, not wait_for: see streaming.SSEResponse._write.
                    async with asyncio.timeout(timeout):
                        await context.write(_response(delta, spec))
                except TimeoutError:
                    log.warning("gRPC caller read nothing for %.1fs; aborting %s", timeout,
                                spec.request_id)
                    record.finish(grpc.StatusCode.DEADLINE_EXCEEDED.name, cancelled="slow_client")
                    # The workers and the admission slot first: the status below queues behind
                    # the write the caller never took, and abort() may wait for it as long as
                    # the caller keeps its connection (it held the slot for up to 40 minutes).
                    await stream.aclose()
                    ticket.release()
                    await _abort_unread(context)
                # After output, a failure is the final message just written (finish_reason
                # ERROR and `error`) and the call ends OK, as an SSE stream ends with its
                # error event: a status such as UNAVAILABLE would invite standard retry
                # policies to replay text the caller already has.
                delta = None if delta.finish_reason else await _next_or_error(stream, delta)
        finally:
            await stream.aclose()  # cancelled callers land here too: the workers abort
            ticket.release()

    def _spec(self, request: gateway_pb2.GenerateTextRequest, request_id: str, limits):
        """Runs in a tokenizer thread (Gateway.off_loop): touches only read-only state."""
        gateway = self.gateway
        which = request.WhichOneof("prompt")
        if which == "text":
            prompt = gateway.preprocessor.encode_text(request.text, limits)
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise APIError.invalid("set prompt: `text` or `token_ids`", param="prompt")
        try:
            params = convert.sampling_from_pb(request.sampling)
        except ValueError as exc:
            raise APIError.invalid(str(exc)) from None
        return gateway.preprocessor.token_prompt(request_id, prompt, params, list(request.stop),
                                                 limits)


async def _next_or_error(stream, last: TextDelta) -> TextDelta | None:
    """The stream's next delta; an unexpected failure becomes a final error delta, as
    streaming.sse_events does (output was delivered: it must not end as a retryable status)."""
    try:
        return await anext(stream, None)
    except Exception as exc:
        log.exception("gRPC stream failed after output")
        return TextDelta(index=last.index, text="", token_ids=(), logprobs=(),
                         num_output_tokens=last.num_output_tokens, finish_reason="error",
                         error=str(exc) or type(exc).__name__, compute=last.compute)


async def _abort_unread(context) -> None:
    """Ends a call whose caller stopped reading: DEADLINE_EXCEEDED if the status gets out
    within a second; else the handler ends anyway (grpc then cancels the stream)."""
    try:
        async with asyncio.timeout(1.0):
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                "the caller stopped reading the stream")
    except TimeoutError:
        raise asyncio.CancelledError from None


async def _abort(context, record: RequestRecord, exc: APIError) -> None:
    """Ends the call with the error's status code, and `retry-after` where it has one. gRPC's
    own retry policies read `grpc-retry-pushback-ms` (gRFC A6): the same wait, or a negative
    one, where HTTP says `x-should-retry: false`, for no retry at all (a request over its
    tenant's whole token bucket shares RESOURCE_EXHAUSTED with a passing quota refusal)."""
    trailers = []
    if exc.retry_after_s is not None:
        trailers.append(("retry-after", str(exc.retry_after_s)))
    if exc.should_retry is False:
        trailers += [("x-should-retry", "false"), ("grpc-retry-pushback-ms", "-1")]
    elif exc.retry_after_s is not None:
        trailers.append(("grpc-retry-pushback-ms", str(int(exc.retry_after_s * 1000))))
    if trailers:
        context.set_trailing_metadata(tuple(trailers))
    record.finish(exc.grpc_code.name, exc)
    await context.abort(exc.grpc_code, exc.message)


def _authorization(request: gateway_pb2.GenerateTextRequest, context) -> str | None:
    if request.api_key:
        return f"Bearer {request.api_key}"
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


def _response(delta: TextDelta, spec) -> gateway_pb2.GenerateTextResponse:
    response = gateway_pb2.GenerateTextResponse(
        text=delta.text, token_ids=delta.token_ids,
        finish_reason=convert.FINISH_REASONS.get(delta.finish_reason,
                                                 common_pb2.FINISH_REASON_ERROR),
        error=delta.error or "",
    )
    if delta.logprobs:
        response.logprobs.extend(convert.logprob_to_pb(t, lp)
                                 for t, lp in zip(delta.token_ids, delta.logprobs, strict=False))
    if delta.prompt_logprobs is not None:
        scored = zip(spec.prompt_token_ids[1:], delta.prompt_logprobs[1:], strict=False)
        response.prompt_logprobs.extend(convert.logprob_to_pb(t, lp) for t, lp in scored)
    if isinstance(delta.stop_reason, str):
        response.stop_string = delta.stop_reason
    elif delta.stop_reason is not None:
        response.stop_token_id = delta.stop_reason
    if delta.finish_reason is not None:
        response.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=len(spec.prompt_token_ids), completion_tokens=delta.num_output_tokens,
            cached_tokens=delta.num_cached_tokens,
            compute_seconds=convert.compute_to_pb(delta.compute)))
    return response


def add_to_server(gateway: Gateway, server: grpc.aio.Server) -> None:
    """Request bytes that do not parse get INVALID_ARGUMENT, as the workers' RPCs do."""
    add_servicer(gateway_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(gateway), server,
                 max_bytes=_max_message_bytes(gateway.config))


def add_health(gateway: Gateway, server: grpc.aio.Server) -> asyncio.Task:
    """grpc.health.v1.Health beside the front door, for gRPC load-balancer checks and
    Kubernetes `grpc` probes: SERVING while the gateway is ready (as /ready: a worker pair to
    route to, not draining), for "" and splitserve.v1.Gateway alike. Returns the task that
    follows readiness; cancel it at shutdown."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = ("", gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name)

    async def follow() -> None:
        last = None
        while True:
            ready = gateway.router.ready() and not gateway.draining
            status = (health_pb2.HealthCheckResponse.SERVING if ready
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            if status != last:
                for name in names:
                    await servicer.set(name, status)
                last = status
            await asyncio.sleep(0.5)

    return asyncio.create_task(follow(), name="grpc-health")


def _max_message_bytes(config) -> int:
    """A front-door message as large as an HTTP body, and the proto's framing beside it."""
    return max(config.max_body_bytes, 4 << 20) + (64 << 10)


def server_options(config) -> list[tuple[str, int]]:
    """The front door's channel settings. Messages as large as an HTTP body (gRPC's default
    4 MiB failed a 5 MB prompt with RESOURCE_EXHAUSTED, the overload code); keepalive that
    load balancers' idle timers and clients' own pings can live with (grpc-go and grpc-java
    clients pinging every 10 s idle were sent GOAWAY "too_many_pings"); and connections that
    end after 30 minutes, once their calls do (within the request timeout; with none, whenever
    they do), so clients spread again over gateway pods."""
    options = [
        # Twice the bound, so that a message over --max-body-bytes reaches the handler's check
        # (INVALID_ARGUMENT, as HTTP's 413): grpc-core's own refusal is RESOURCE_EXHAUSTED,
        # the overload code. Past twice, grpc-core still refuses it unread.
        ("grpc.max_receive_message_length", 2 * _max_message_bytes(config)),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.max_connection_age_ms", 30 * 60_000),
        # gRPC binds with SO_REUSEPORT by default: a second gateway on a taken --grpc-port
        # started, said it was ready, and the two shared the port's calls. Off, the bind fails.
        ("grpc.so_reuseport", 0),
    ]
    if config.request_timeout_s > 0:
        options.append(("grpc.max_connection_age_grace_ms",
                        int((config.request_timeout_s + 10) * 1000)))
    return options
