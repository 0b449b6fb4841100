"""One request as the gateway observes it, from arrival to its last byte: per-choice token
timings, the gateway's trace span (admission, queue wait, routing), the outcome, and at the end
the request's metrics and one access-log line.

A RequestRecord is owned by the event-loop task serving its request; `finish` runs once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry

from engine.outputs import ComputeSeconds
from services.common import tracing
from services.gateway.api.text_stream import TextDelta
from services.gateway.errors import APIError
from services.gateway.request_metrics import RequestMetrics

access_log = logging.getLogger("splitserve.access")
_tracer = tracing.tracer("splitserve.gateway")


class RequestObserver:
    """Opens a RequestRecord per request; shared by both front doors."""

    def __init__(self, model: str, registry: CollectorRegistry, log_prompts: bool = False) -> None:
        self.model = model
        self.metrics = RequestMetrics(registry)
        self.log_prompts = log_prompts  # debug only: prompt text in the access log

    def begin(self, api: str, request_id: str, parent=None, endpoint: str = "") -> RequestRecord:
        """`api`: "http" or "grpc"; `parent`: the caller's trace context, if it sent one;
        `endpoint`: the path (/v1/chat/completions) or the gRPC method."""
        return RequestRecord(self, api, request_id, parent, endpoint)


@dataclass
class _Choice:
    first_at: float | None = None
    last_at: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error_code: str | None = None  # with finish_reason "error": why (None: a worker failed)
    compute: ComputeSeconds = ComputeSeconds()  # the choice's running total


class RequestRecord:
    def __init__(self, observer: RequestObserver, api: str, request_id: str, parent,
                 endpoint: str = "") -> None:
        self.observer = observer
        self.api = api
        self.endpoint = endpoint
        self.request_id = request_id
        self.arrival = time.monotonic()
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()
        self.tenant = "unknown"  # until authenticated
        self.client = ""  # its address (api/client_address.py), set by the front door
        self.prompt_tokens = 0
        self.prompt_text: str | None = None  # kept only under the debug flag
        self.queue_s: float | None = None
        self.first_token_at: float | None = None
        self.cached_tokens = 0
        self.transfer_bytes = 0
        self.decode_worker = self.prefill_worker = ""
        self.migrations: list[str] = []  # reasons, one per move of any choice
        self._migration_spans: list = []  # open "gateway.migration" spans, until resumed
        self.choices: list[_Choice] = []
        self.done = False
        self.span = _tracer.start_span(
            "gateway.request", context=parent, kind=SpanKind.SERVER,
            attributes={"splitserve.request_id": request_id, "splitserve.api": api,
                        "splitserve.endpoint": endpoint})
        # Sent with every worker RPC of this request: the worker spans become its children.
        self.grpc_metadata: tuple[tuple[str, str], ...] = tuple(tracing.grpc_metadata(self.span))

    @property
    def compute(self) -> ComputeSeconds:
        """What the workers charged, all choices, whether or not their streams finished."""
        return sum((c.compute for c in self.choices), ComputeSeconds())

    # -- what the front door tells it -----------------------------------------------------

    def authenticated(self, tenant: str) -> None:
        self.tenant = tenant
        self.span.set_attribute("splitserve.tenant", tenant)

    def prompt(self, prompt_tokens: int, text=None) -> None:
        """`text`: a callable giving the prompt text, called only under the debug flag."""
        self.prompt_tokens = prompt_tokens
        self.span.set_attribute("splitserve.prompt_tokens", prompt_tokens)
        if self.observer.log_prompts and text is not None:
            self.prompt_text = text()

    def admitted(self, arrival: float, released_at: float | None) -> None:
        """The request left the fair queue (monotonic times from its admission Ticket)."""
        if released_at is None:
            return
        self.queue_s = released_at - arrival
        if self.span.is_recording():
            queue = _tracer.start_span(
                "gateway.queue", context=trace.set_span_in_context(self.span),
                start_time=self._epoch_ns(arrival),
                attributes={"splitserve.tenant": self.tenant})
            queue.end(end_time=self._epoch_ns(released_at))

    def client_gone(self, status: int | str) -> None:
        """The client left (or cancelled) before the end of its response: that ends it."""
        if self.done:
            return
        stage = ("queued" if self.queue_s is None
                 else "before_first_token" if self.first_token_at is None
                 else "after_first_token")
        self.observer.metrics.disconnects.labels(self.observer.model, self.tenant, stage).inc()
        self.span.add_event("client_disconnected", {"stage": stage})
        self.finish(status, cancelled="client_disconnected")

    def observe(self, streams: Sequence[AsyncIterator[TextDelta]]) -> list[AsyncIterator[TextDelta]]:
        """The choice streams, timed as their tokens pass."""
        return [self._observe(s) for s in streams]

    def dispatching(self, dispatcher) -> _RecordedDispatcher:
        """`dispatcher`, reporting every attempt of this request here."""
        return _RecordedDispatcher(dispatcher, self)

    # -- what the dispatcher tells it (dispatcher.AttemptObserver) ------------------------

    def routed(self, route, attempt: int) -> None:
        decode, prefill = route.decode, route.prefill
        routing = self.observer.metrics.routing
        label = route.reason_label
        routing.labels(decode.role, decode.address, label).inc()
        self.decode_worker = decode.worker_id or decode.address
        if prefill is not None:
            routing.labels(prefill.role, prefill.address, label).inc()
            self.prefill_worker = prefill.worker_id or prefill.address
        self.span.add_event("route", {
            "attempt": attempt, "reason": route.reason, "decode_worker": self.decode_worker,
            "prefill_worker": self.prefill_worker if prefill is not None else "",
            "cached_tokens_estimate": route.cached_tokens})

    def prefilled(self, kv_bytes: int, cached_tokens: int) -> None:
        self.transfer_bytes += kv_bytes
        self.cached_tokens = max(self.cached_tokens, cached_tokens)

    def migrating(self, reason: str, worker: str, move: int, resumed_tokens: int) -> None:
        self.migrations.append(reason)
        self.observer.metrics.migrations.labels(self.observer.model, reason).inc()
        # One span per move, from the break to the first token after it: the client's stall.
        self._migration_spans.append(_tracer.start_span(
            "gateway.migration", context=trace.set_span_in_context(self.span),
            attributes={"splitserve.migration.reason": reason,
                        "splitserve.migration.from_worker": worker,
                        "splitserve.migration.move": move,
                        "splitserve.migration.resumed_tokens": resumed_tokens}))

    def resumed(self) -> None:
        if self._migration_spans:
            span = self._migration_spans.pop(0)
            span.set_attribute("splitserve.migration.to_worker", self.decode_worker)
            span.end()

    def migration_failed(self, reason: str) -> None:
        self.observer.metrics.migration_failures.labels(self.observer.model, reason).inc()
        if self._migration_spans:
            span = self._migration_spans.pop(0)
            span.set_status(Status(StatusCode.ERROR, reason))
            span.end()

    # -- the end --------------------------------------------------------------------------

    def finish(self, status: int | str, error: BaseException | None = None,
               cancelled: str | None = None) -> None:
        """Once, when the last byte went out or the request ended otherwise. `status`: the
        HTTP status or gRPC code name; `cancelled`: why it was cut short, if it was."""
        if self.done:
            return
        self.done = True
        for span in self._migration_spans:  # a move still under way when the request ended
            span.end()
        self._migration_spans.clear()
        now = time.monotonic()
        if not self.prompt_tokens and getattr(error, "prompt_tokens", None):
            self.prompt_tokens = error.prompt_tokens  # refused for its length, before admission
        outcome, reason = self._outcome(error, cancelled)
        metrics, model = self.observer.metrics, self.observer.model
        metrics.requests.labels(model, self.tenant, outcome, reason).inc()
        last = max((c.last_at for c in self.choices if c.last_at is not None), default=None)
        if outcome == "finished":
            metrics.e2e.labels(model, self.tenant).observe((last or now) - self.arrival)
            tpot = metrics.tpot.labels(model, self.tenant)
            for c in self.choices:
                if c.output_tokens > 1 and c.first_at is not None:
                    tpot.observe((c.last_at - c.first_at) / (c.output_tokens - 1))
        output_tokens = sum(c.output_tokens for c in self.choices)
        compute = self.compute
        if compute.total > 0:
            counter = metrics.tenant_compute
            for phase, seconds in (("prefill", compute.prefill), ("decode", compute.decode),
                                   ("transfer", compute.transfer)):
                counter.labels(self.tenant, phase).inc(seconds)
        ttft = None if self.first_token_at is None else self.first_token_at - self.arrival
        span = self.span
        if span.is_recording():
            span.set_attributes({
                "splitserve.tenant": self.tenant, "splitserve.outcome": outcome,
                "splitserve.reason": reason, "splitserve.output_tokens": output_tokens,
                "splitserve.cached_prefix_tokens": self.cached_tokens,
                "splitserve.transfer_bytes": self.transfer_bytes,
                "splitserve.decode_worker": self.decode_worker,
                "splitserve.prefill_worker": self.prefill_worker,
                "splitserve.migrations": len(self.migrations),
                "splitserve.status": str(status)})
            if outcome == "error":
                span.set_status(Status(StatusCode.ERROR, reason))
        span.end()
        if access_log.isEnabledFor(logging.INFO):
            self._log_access(status, outcome, reason, output_tokens, ttft, now)

    # -- the parts ------------------------------------------------------------------------

    async def _observe(self, stream: AsyncIterator[TextDelta]) -> AsyncIterator[TextDelta]:
        choice = _Choice()
        self.choices.append(choice)
        itl = self.observer.metrics.itl.labels(self.observer.model, self.tenant)
        try:
            async for delta in stream:
                if delta.token_ids:
                    now = time.monotonic()
                    if choice.first_at is None:
                        choice.first_at = now
                        if self.first_token_at is None:
                            self.first_token_at = now
                            self.span.add_event("first_token")
                    else:
                        # Tokens that came together share the gap before them.
                        count = len(delta.token_ids)
                        gap = (now - choice.last_at) / count
                        for _ in range(count):
                            itl.observe(gap)
                    choice.last_at = now
                    choice.output_tokens = delta.num_output_tokens
                choice.compute = delta.compute
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    choice.error_code = delta.error_code
                    self.cached_tokens = max(self.cached_tokens, delta.num_cached_tokens)
                yield delta
        finally:
            await stream.aclose()

    def _outcome(self, error: BaseException | None, cancelled: str | None) -> tuple[str, str]:
        if isinstance(error, APIError):
            if error.rejected_by:
                return "rejected", error.rejected_by
            if error.status < 500:
                return "rejected", error.code or "invalid_request"
            return "error", error.code or "server_error"
        if error is not None:
            return "error", "internal_error"
        if cancelled is not None:
            return "cancelled", cancelled
        reasons = [c.finish_reason for c in self.choices]
        if "error" in reasons:
            return "error", next((c.error_code for c in self.choices if c.error_code),
                                 "worker_failed")
        if not reasons or None in reasons:
            return "cancelled", "incomplete"
        return "finished", "length" if "length" in reasons else "stop"

    def _epoch_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns

    def _log_access(self, status, outcome: str, reason: str, output_tokens: int,
                    ttft: float | None, now: float) -> None:
        e2e = now - self.arrival
        trace_id = self.span.get_span_context().trace_id
        fields = {
            "request_id": self.request_id, "api": self.api, "endpoint": self.endpoint or None,
            "tenant": self.tenant, "client": self.client or None,
            "status": status, "outcome": outcome, "reason": reason,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": output_tokens,
            "cached_tokens": self.cached_tokens,
            "compute_seconds": {"prefill": round(self.compute.prefill, 6),
                                "decode": round(self.compute.decode, 6),
                                "transfer": round(self.compute.transfer, 6)},
            "queue_s": None if self.queue_s is None else round(self.queue_s, 6),
            "ttft_s": None if ttft is None else round(ttft, 6), "e2e_s": round(e2e, 6),
            "decode_worker": self.decode_worker or None,
            "prefill_worker": self.prefill_worker or None,
            "migrations": len(self.migrations),
            "migration_reasons": ",".join(self.migrations) or None,
            "trace_id": format(trace_id, "032x") if trace_id else None,
            "prompt": self.prompt_text,
        }
        moved = f" migrated={','.join(self.migrations)}" if self.migrations else ""
        access_log.info("%s %s %s %s(%s) %d+%d tokens %.3fs%s", self.api, self.request_id,
                        status, outcome, reason, self.prompt_tokens, output_tokens, e2e, moved,
                        extra=fields)


class _RecordedDispatcher:
    def __init__(self, dispatcher, record: RequestRecord) -> None:
        self.dispatcher = dispatcher
        self.record = record

    def generate(self, request_id, prompt_token_ids, sampling, cache_salt="") -> AsyncIterator:
        return self.dispatcher.generate(request_id, prompt_token_ids, sampling,
                                        observer=self.record, cache_salt=cache_salt)
