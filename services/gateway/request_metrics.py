"""Prometheus metrics of requests as the gateway serves them: token latencies, end-to-end time,
outcomes, routing decisions, client disconnects and request migrations. Admission's own series (TTFT, queue wait,
queue depth, in-flight, tokens per tenant, rejections) live in admission/metrics.py; both share
one registry, the one `/metrics` serves.

Updated on the gateway's event loop only. Label values are bounded: `tenant` comes from the
tenants file (or is "anonymous"/"unknown"), `reason` from fixed sets, `worker` from the pool
(a worker's values are removed when it leaves it).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import E2E_BUCKETS, LATENCY_BUCKETS

OUTCOMES = ("finished", "cancelled", "rejected", "error")


class RequestMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model", "tenant"]
        self.itl = Histogram(
            "splitserve_gateway_itl_seconds",
            "Inter-token latency: the gap before each output token after the first.",
            labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram(
            "splitserve_gateway_time_per_output_token_seconds",
            "Per choice: (last token - first token) / (output tokens - 1).",
            labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram(
            "splitserve_gateway_e2e_latency_seconds",
            "Arrival to the last token of a finished request.",
            labels, buckets=E2E_BUCKETS, registry=registry)
        self.requests = Counter(
            "splitserve_gateway_requests",
            "Requests by outcome (finished, cancelled, rejected, error) and reason.",
            ["model", "tenant", "outcome", "reason"], registry=registry)
        self.routing = Counter(
            "splitserve_gateway_routing_decisions",
            "Workers chosen per attempt, by role, worker address and placement reason.",
            ["role", "worker", "reason"], registry=registry)
        self.disconnects = Counter(
            "splitserve_gateway_client_disconnects",
            "Clients that left before the end of their response, by stage "
            "(queued, before_first_token, after_first_token).",
            ["model", "tenant", "stage"], registry=registry)
        self.migrations = Counter(
            "splitserve_gateway_migrations",
            "Streams moved to another decode worker after tokens were sent, by reason "
            "(draining, worker_failed, stream_ended, diverged).",
            ["model", "reason"], registry=registry)
        # Cost per query: engine seconds the workers charged to the tenant's requests.
        self.tenant_compute = Counter(
            "splitserve_tenant_compute_seconds",
            "Worker engine seconds charged to the tenant's requests, by phase (prefill, "
            "decode, transfer), as the workers reported them in each request's final usage.",
            ["tenant", "phase"], registry=registry)
        self.open_connections = Gauge(
            "splitserve_gateway_open_connections",
            "Client connections open on the API port (--max-connections bounds them).",
            registry=registry)
        self.connections_closed = Counter(
            "splitserve_gateway_connections_closed",
            "Client connections the gateway closed before a request: over --max-connections "
            "(limit), or headers not in within --request-read-timeout-s (header_timeout).",
            ["reason"], registry=registry)
        self.migration_failures = Counter(
            "splitserve_gateway_migration_failures",
            "Broken streams that could not move (migration limit reached, no worker left, "
            "not migratable) and ended with an error, by the reason of the last break.",
            ["model", "reason"], registry=registry)

    def forget_worker(self, address: str) -> None:
        """Drop the series of a worker that left the pool: `worker` label values stay bounded
        by the live pool, not by every address a pod ever had."""
        stale = {(sample.labels["role"], sample.labels["reason"])
                 for family in self.routing.collect() for sample in family.samples
                 if sample.labels.get("worker") == address}
        for role, reason in stale:
            self.routing.remove(role, address, reason)
