"""OpenTelemetry tracing for every splitserve process.

Exporters follow the standard environment: OTEL_TRACES_EXPORTER (otlp | console | none),
OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT (setting one implies otlp), OTEL_TRACES_SAMPLER and
OTEL_TRACES_SAMPLER_ARG for the sampling ratio; OTEL_SERVICE_NAME (or service.name in
OTEL_RESOURCE_ATTRIBUTES) wins over the process's own name (splitserve-gateway, -prefill, ...).
SPLITSERVE_TRACE_FILE adds a JSON-lines file exporter (one span per line), used by tests.
With none of these set, tracing is a no-op.
W3C trace context travels in gRPC metadata (`traceparent`).
"""

from __future__ import annotations

import json
import os
import threading

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)

_configured = False


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object per line (safe across processes:
    each span is a single O_APPEND write)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans) -> SpanExportResult:
        lines = []
        for span in spans:
            parent = span.parent
            lines.append(json.dumps({
                "name": span.name,
                "service": span.resource.attributes.get("service.name"),
                "trace_id": format(span.context.trace_id, "032x"),
                "span_id": format(span.context.span_id, "016x"),
                "parent_id": format(parent.span_id, "016x") if parent else None,
                "start_ns": span.start_time,
                "end_ns": span.end_time,
                "attributes": dict(span.attributes or {}),
                "events": [{"name": event.name, "time_ns": event.timestamp,
                            "attributes": dict(event.attributes or {})}
                           for event in span.events],
            }))
        data = ("\n".join(lines) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS


def service_resource(default_service: str) -> Resource:
    """The standard resource environment (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES) as the
    SDK reads it, with `default_service` as service.name only where neither names one."""
    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": default_service}))
    return resource


def setup_tracing(service: str) -> bool:
    """Install a tracer provider if the environment asks for one; returns whether it did."""
    global _configured
    if _configured:
        return True
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").lower()
    endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if not exporter and endpoint:
        exporter = "otlp"
    trace_file = os.environ.get("SPLITSERVE_TRACE_FILE")
    if exporter in ("", "none") and not trace_file:
        return False
    provider = TracerProvider(resource=service_resource(service))
    if exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    elif exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    if trace_file:
        # Batched like the others, off the request path: a span costs an append to a queue,
        # and a background thread writes them out within half a second.
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file),
                                                       schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _configured = True
    return True


def shutdown_tracing() -> None:
    provider = trace.get_tracer_provider()
    if hasattr(provider, "shutdown"):
        provider.shutdown()


# FastAPI (0.163 on) traces every HTTP request on its own once a tracer provider is set, with
# spans for dependency resolution and the endpoint: each probe and scrape became a trace, and a
# request's HTTP span sat beside gateway.request instead of above it. Every app here is built
# with this: the request's spans are ours (gateway.request and below).
FASTAPI_TELEMETRY_OFF = {"tracing": False, "metrics": False, "logs": False,
                         "operation_spans": False}


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def context_from_grpc(context) -> object:
    """The caller's trace context from gRPC invocation metadata."""
    carrier = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def grpc_metadata(span: trace.Span | None = None) -> list[tuple[str, str]]:
    """Metadata carrying `span`'s trace context (default: the current one) to the next hop."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span) if span else None)
    return list(carrier.items())


def context_from_headers(headers) -> object:
    """The caller's trace context from HTTP headers (`traceparent`, `tracestate`)."""
    return propagate.extract(headers)
