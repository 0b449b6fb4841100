"""splitserve.v1.Gateway: the gRPC front door. Same path as HTTP (admission, preprocessing,
dispatcher, stop strings) with protobuf in and out; runs on the gateway's event loop."""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc
from splitserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from services.common import convert, tracing
from services.gateway.errors import APIError
from services.gateway.gateway import Gateway
from services.gateway.request_record import RequestRecord
from services.gateway.text_stream import TextDelta

log = logging.getLogger(__name__)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Generate(self, request: gateway_pb2.GenerateTextRequest, context):
        record = self.gateway.observer.begin(
            "grpc", f"{request.request_id or uuid.uuid4().hex}-{uuid.uuid4().hex[:8]}",
            tracing.context_from_grpc(context))
        try:
            await self._generate(request, context, record)
        except asyncio.CancelledError:  # the caller cancelled or went away
            record.client_gone(grpc.StatusCode.CANCELLED.name)
            raise
        except BaseException as exc:  # an abort was recorded before it was raised
            record.finish(grpc.StatusCode.UNKNOWN.name, exc)
            raise
        record.finish(grpc.StatusCode.OK.name)

    async def _generate(self, request, context, record: RequestRecord) -> None:
        gateway = self.gateway
        try:
            tenant = gateway.admission.authenticate(_authorization(request, context))
            record.authenticated(tenant.name)
            if request.model:
                gateway.check_model(request.model)
            spec = self._spec(request, record.request_id)
            record.prompt(len(spec.prompt_token_ids),
                          lambda: gateway.tokenizer.decode(spec.prompt_token_ids))
            # Waits in the fair queue; a cancelled call gives its place up.
            ticket = await gateway.admission.admit(tenant, [spec], len(spec.prompt_token_ids))
        except APIError as exc:
            if exc.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            record.finish(exc.grpc_code.name, exc)
            await context.abort(exc.grpc_code, exc.message)
        spec = ticket.specs[0]  # max_tokens within the tenant's limit
        (stream,) = gateway.choice_streams(ticket, record)
        timeout = gateway.config.slow_client_timeout_s
        try:
            try:
                first = await anext(stream)
            except APIError as exc:
                record.finish(exc.grpc_code.name, exc)
                await context.abort(exc.grpc_code, exc.message)
            delta: TextDelta | None = first
            while delta is not None:
                try:
                    # A caller that stops reading stalls this write (HTTP/2 flow control).
                    # asyncio.timeout, not wait_for: see streaming.SSEResponse._write.
                    async with asyncio.timeout(timeout):
                        await context.write(_response(delta, spec))
                except TimeoutError:
                    log.warning("gRPC caller read nothing for %.1fs; aborting %s", timeout,
                                spec.request_id)
                    record.finish(grpc.StatusCode.DEADLINE_EXCEEDED.name, cancelled="slow_client")
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        "the caller stopped reading the stream")
                if delta.finish_reason == "error":
                    record.finish(grpc.StatusCode.UNAVAILABLE.name)  # outcome: worker_failed
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        delta.error or "a worker failed mid-stream")
                delta = None if delta.finish_reason else await anext(stream, None)
        finally:
            await stream.aclose()  # cancelled callers land here too: the workers abort
            ticket.release()

    def _spec(self, request: gateway_pb2.GenerateTextRequest, request_id: str):
        gateway = self.gateway
        which = request.WhichOneof("prompt")
        if which == "text":
            prompt = gateway.tokenizer.encode(request.text)
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
        else:
            raise APIError.invalid("set prompt: `text` or `token_ids`", param="prompt")
        try:
            params = convert.sampling_from_pb(request.sampling)
        except ValueError as exc:
            raise APIError.invalid(str(exc)) from None
        return gateway.preprocessor.token_prompt(request_id, prompt, params, list(request.stop),
                                                 gateway.limits())


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
    if delta.finish_reason is not None:
        response.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=len(spec.prompt_token_ids), completion_tokens=delta.num_output_tokens,
            cached_tokens=delta.num_cached_tokens))
    return response


def add_to_server(gateway: Gateway, server: grpc.aio.Server) -> None:
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(gateway), server)
