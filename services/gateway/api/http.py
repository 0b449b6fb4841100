"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models and health
on the public port; readiness, metrics and the OpenAPI document on the admin port. Every error
leaves as OpenAI's error body with a meaningful status."""

from __future__ import annotations

import asyncio
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from engine.outputs import ComputeSeconds
from services.common import tracing
from services.gateway.admission.tenants import Tenant
from services.gateway.admission.ticket import Ticket
from services.gateway.api.deadline import SHUTTING_DOWN, TIMEOUT_CODES, RequestDeadline
from services.gateway.api.openapi import body_doc, openapi_document
from services.gateway.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeRequest,
    parse_body,
)
from services.gateway.api.request_body import read_body
from services.gateway.api.request_ids import gateway_request_id, worker_request_id
from services.gateway.api.responses import (
    ChatFormat,
    ChoiceResult,
    CompletionFormat,
    usage,
)
from services.gateway.api.responses_api import ResponsesFormat
from services.gateway.api.responses_protocol import ResponsesRequest
from services.gateway.api.streaming import (
    ClientDisconnected,
    SSEResponse,
    open_streams,
    sse_events,
    until_disconnected,
)
from services.gateway.errors import APIError
from services.gateway.gateway import Gateway
from services.gateway.request_record import RequestRecord
from services.gateway.routing.dispatcher import NO_WORKER

log = logging.getLogger(__name__)


def create_app(gateway: Gateway) -> FastAPI:
    """The public port: the API and /health, nothing that describes the cluster."""
    app = FastAPI(title="splitserve gateway", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry=tracing.FASTAPI_TELEMETRY_OFF)
    _install_error_handlers(app)
    app.openapi = lambda: openapi_document(app)
    if gateway.config.allowed_origins:
        # Browsers may then call the API from these origins (preflight answered, responses
        # readable); API keys still apply.
        app.add_middleware(CORSMiddleware, allow_origins=list(gateway.config.allowed_origins),
                           allow_methods=["GET", "POST"], allow_headers=["*"],
                           expose_headers=["x-request-id", "retry-after"])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    # vLLM's (and SageMaker's) liveness path, GET or POST: the same answer as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"])

    @app.get("/version")
    async def version() -> dict:
        """vLLM's path (its own version there; splitserve's here): deployment checks and
        clients that probe a server before use ask it."""
        return {"version": gateway.version}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gateway.admission.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [gateway.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        gateway.admission.authenticate(request.headers.get("authorization"))
        gateway.check_model(model_id)
        return gateway.model_card()

    @app.post("/v1/completions", openapi_extra=body_doc(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await _generate(gateway, request, CompletionRequest,
                               lambda *args: (gateway.preprocessor.completion(*args), {}),
                               CompletionFormat)

    @app.post("/v1/chat/completions", openapi_extra=body_doc(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        def chat(*args):
            specs, tools = gateway.preprocessor.chat_with_tools(*args)
            return specs, {"tools": tools}

        return await _generate(gateway, request, ChatCompletionRequest, chat, ChatFormat)

    @app.post("/v1/responses", openapi_extra=body_doc(ResponsesRequest))
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, text only: served as the chat completion it amounts to."""
        def respond(request_id, req: ResponsesRequest, limits):
            specs, tools = gateway.preprocessor.chat_with_tools(request_id, req.as_chat(),
                                                                limits)
            return specs, {"echo": req.echo(), "tools": tools}

        return await _generate(gateway, request, ResponsesRequest, respond, ResponsesFormat)

    @app.post("/tokenize", openapi_extra=body_doc(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        """vLLM's: a prompt's (or a conversation's templated) token ids, nothing generated."""
        def run(body: bytes, limits):
            chat = b'"messages"' in body
            req = parse_body(TokenizeChatRequest if chat else TokenizeRequest, body)
            if req.model is not None:
                gateway.check_model(req.model)
            return gateway.preprocessor.tokenize(req, limits)

        return await _tokenizer_call(gateway, request, run)

    @app.post("/detokenize", openapi_extra=body_doc(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        def run(body: bytes, limits):
            req = parse_body(DetokenizeRequest, body)
            if req.model is not None:
                gateway.check_model(req.model)
            return gateway.preprocessor.detokenize(req, limits)

        return await _tokenizer_call(gateway, request, run)

    return app


async def _tokenizer_call(gateway: Gateway, request: Request, run) -> dict:
    """/tokenize and /detokenize: authenticated like the API, the body size-limited and the
    work done off the event loop; no worker is involved."""
    gateway.admission.authenticate(request.headers.get("authorization"))
    body = await read_body(request, gateway.config, gateway.bodies)
    return await gateway.off_loop(len(body), run, body, gateway.limits())


def create_admin_app(gateway: Gateway) -> FastAPI:
    """The admin port (127.0.0.1 unless --admin-host says otherwise): what probes, Prometheus
    and operators read; it lists worker addresses, so it never shares the public port."""
    app = FastAPI(title="splitserve gateway admin", docs_url=None, redoc_url=None,
                  openapi_url=None, telemetry=tracing.FASTAPI_TELEMETRY_OFF)
    _install_error_handlers(app)
    public = create_app(gateway)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    def workers() -> list[dict]:
        return [{"address": e.address, "role": e.role, "routable": e.routable,
                 "kv_blocks_free": e.health.stats.kv_blocks_free if e.health else None}
                for e in gateway.pool.endpoints]

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """200 while requests can be routed: a prefill/decode pair is reachable."""
        if gateway.router.ready() and not gateway.draining:
            return JSONResponse({"status": "ready", "workers": workers()})
        error = APIError.overloaded("No prefill/decode worker pair is reachable yet.", 1)
        return JSONResponse({**error.body(), "workers": workers()}, 503, headers=error.headers())

    @app.get("/ready/self")
    async def ready_self() -> JSONResponse:
        """200 while this gateway takes requests (not draining), workers or none: the
        Kubernetes readiness probe. On /ready, an outage of every worker took every gateway
        out of its Service, and clients met connection resets and load-balancer pages instead
        of the gateway's own 503 with Retry-After."""
        if not gateway.draining:
            return JSONResponse({"status": "ready", "routable": gateway.router.ready(),
                                 "workers": workers()})
        error = APIError.shutting_down()
        return JSONResponse(error.body(), 503, headers=error.headers())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.admission.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/openapi.json")
    async def openapi() -> JSONResponse:
        """The public port's API."""
        return JSONResponse(public.openapi())

    return app


async def _generate(gateway: Gateway, request: Request, body_type, preprocess,
                    format_type) -> Response:
    """One completions or chat completions request: authenticate, parse, check the model,
    turn it into generation specs (and `format_type`'s options) with `preprocess`, serve them
    in `format_type`; all of it within the request's deadline."""
    record, bad_id = _begin(gateway, request)
    try:
        if bad_id is not None:
            raise bad_id
        tenant = gateway.admission.authenticate(request.headers.get("authorization"))
        record.authenticated(tenant.name)
        share = gateway.admission.share_of(tenant, record.client)
        config = gateway.config
        deadline = RequestDeadline.for_http(config, request.headers, record.arrival,
                                            gateway.cutoff)
        body = await deadline.within(read_body(request, config, gateway.bodies),
                                     "reading the body")
        # Parsing, the chat template and tokenizing are CPU work: off the event loop.
        with gateway.admission.preparing(tenant, share):
            req, (specs, format_options) = await deadline.within(gateway.off_loop(
                len(body), _prepare, gateway, body_type, body, preprocess,
                worker_request_id(record.request_id), gateway.limits()), "tokenizing")
        fmt = format_type(gateway.model_name, gateway.tokenizer, specs, req.include_usage,
                          continuous_usage=getattr(req, "continuous_usage", False),
                          system_fingerprint=gateway.system_fingerprint, **format_options)
        return await _serve(gateway, request, record, specs, fmt, req.stream, tenant, share,
                            req.n, deadline)
    except BaseException as exc:
        _failed(record, exc)
        raise


def _prepare(gateway: Gateway, body_type, body: bytes, preprocess, request_id: str, limits):
    """Runs in a tokenizer thread: touches only read-only state."""
    req = parse_body(body_type, body)
    if req.model is not None:
        gateway.check_model(req.model)
    return req, preprocess(request_id, req, limits)


def _begin(gateway: Gateway, request: Request) -> tuple[RequestRecord, APIError | None]:
    """The request's record, and the 400 to answer if its x-request-id is not acceptable (the
    record then has an id of its own, so that the refusal is logged and counted)."""
    try:
        request_id = gateway_request_id(request.headers.get("x-request-id"),
                                        gateway.config.max_request_id_length, "x-request-id")
        bad_id = None
    except APIError as exc:
        request_id, bad_id = uuid.uuid4().hex, exc
    record = gateway.observer.begin("http", request_id,
                                    tracing.context_from_headers(request.headers),
                                    request.url.path)
    request.state.request_id = record.request_id  # for an error answered by the handlers
    peer = request.client.host if request.client else None
    record.client = gateway.clients.client(peer, request.headers.getlist("x-forwarded-for"))
    return record, bad_id


def _failed(record: RequestRecord, exc: BaseException) -> None:
    """Records a request that ended in an exception (no-op if it was recorded already)."""
    if isinstance(exc, asyncio.CancelledError | ClientDisconnected):
        record.client_gone(499)
    else:
        record.finish(exc.status if isinstance(exc, APIError) else 500, exc)


async def _serve(gateway: Gateway, request: Request, record: RequestRecord, specs, fmt,
                 stream: bool, tenant: Tenant, share: str, n: int,
                 deadline: RequestDeadline) -> Response:
    # Prompt tokens count once per prompt, however many choices (n) sample from it.
    prompt_tokens = sum(len(s.prompt_token_ids) for s in specs if s.index % n == 0)
    record.prompt(prompt_tokens, lambda: gateway.tokenizer.decode(specs[0].prompt_token_ids))
    headers = {"x-request-id": record.request_id}
    try:
        # Waits in the fair queue; a client that leaves meanwhile gives its place up.
        ticket = await until_disconnected(request.receive, deadline.within(
            gateway.admission.admit(tenant, specs, prompt_tokens, share), "queued"))
    except ClientDisconnected:
        log.info("client disconnected while queued; request dropped",
                 extra={"request_id": record.request_id})
        record.client_gone(499)
        return Response(status_code=499)
    try:
        if stream:
            return await _serve_stream(gateway, request, record, fmt, prompt_tokens, ticket,
                                       headers, deadline)
        choices = await until_disconnected(request.receive,
                                           _collect(gateway, ticket, record, deadline))
    except ClientDisconnected:
        log.info("client disconnected before the response; request aborted",
                 extra={"request_id": record.request_id})
        record.client_gone(499)
        return Response(status_code=499)
    finally:
        if not stream:
            ticket.release()
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:  # nothing was sent yet: a status code says what happened
        if failed.error_code == "invalid_structured_output":  # the constraint's, not ours
            raise APIError.invalid(failed.error, code=failed.error_code)
        if failed.error_code == SHUTTING_DOWN:  # another replica may serve it
            raise APIError.shutting_down()
        if failed.error_code == NO_WORKER:  # none to move to: as before its first token
            raise APIError.overloaded(failed.error)
        timed_out = failed.error_code in TIMEOUT_CODES
        raise APIError(504 if timed_out else 500,
                       failed.error or "a worker failed mid-generation", "server_error",
                       code=failed.error_code if timed_out else "worker_failed")
    body = fmt.response(choices, usage(prompt_tokens, sum(c.num_output_tokens for c in choices),
                                       max(c.num_cached_tokens for c in choices),
                                       sum((c.compute for c in choices), ComputeSeconds())))
    record.finish(200)
    return JSONResponse(body, headers=headers)


async def _serve_stream(gateway, request, record: RequestRecord, fmt, prompt_tokens,
                        ticket: Ticket, headers, deadline: RequestDeadline) -> Response:
    try:
        streams = gateway.choice_streams(ticket, record, deadline)
        # Wait for the first token of every choice before committing to a 200, so that
        # failures before any token (after one invisible retry) still get a status code.
        firsts = await until_disconnected(request.receive, open_streams(streams))
    except BaseException:
        ticket.release()
        raise
    events = sse_events(streams, firsts, fmt, prompt_tokens, gateway.config.stream_buffer_chunks)

    async def close(ended: str) -> None:
        ticket.release()
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        if ended == "client_disconnected":
            record.client_gone(200)
        else:
            record.finish(200, cancelled=None if ended == "complete" else ended)

    return SSEResponse(events, gateway.config.slow_client_timeout_s, headers, on_close=close)


async def _collect(gateway: Gateway, ticket: Ticket, record: RequestRecord,
                   deadline: RequestDeadline) -> list[ChoiceResult]:
    results = [ChoiceResult(spec.index) for spec in ticket.specs]

    async def run(stream, result: ChoiceResult) -> None:
        async for delta in stream:
            result.add(delta)

    streams = gateway.choice_streams(ticket, record, deadline)
    tasks = [asyncio.ensure_future(run(s, r)) for s, r in zip(streams, results, strict=True)]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
    return results


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        request_id = getattr(request.state, "request_id", None)
        if exc.status >= 500:
            log.warning("%s %s -> %d %s: %s", request.method, request.url.path, exc.status,
                        exc.code or exc.type, exc.message,
                        extra={"request_id": request_id} if request_id else None)
        headers = exc.headers()
        if request_id:  # the id the access log and the traces know it by
            headers["x-request-id"] = request_id
        return JSONResponse(exc.body(), exc.status, headers=headers)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it: the client left mid-body

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        error = APIError.invalid(f"Invalid request: {first.get('msg', exc)}", param=param)
        return JSONResponse(error.body(), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error = APIError.not_found(request.url.path)
        else:
            error = APIError(exc.status_code, str(exc.detail), "invalid_request_error")
        return JSONResponse(error.body(), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(APIError.internal("internal gateway error").body(), 500)
