"""Prometheus metrics of admission: decisions per tenant and reason, queue depth, time to first
token, the quota backend's state (shared in Redis or local under fail-open).

Counters and histograms are updated on the event loop; queue and quota gauges are read from
the admission objects at scrape time. Tenant labels are bounded by the tenants file.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.metrics import TTFT_BUCKETS, process_registry


class AdmissionMetrics:
    def __init__(self) -> None:
        self.registry = process_registry()
        self.admission = None  # set by Admission; read at scrape time
        self.model = ""  # the served model's name, set by the gateway (label of the latencies)
        self.admitted = Counter(
            "splitserve_gateway_admitted_requests", "Requests admitted (quota taken, queued).",
            ["tenant"], registry=self.registry)
        self.rejected = Counter(
            "splitserve_gateway_rejected_requests",
            "Requests refused by admission, by reason (quota_tokens, quota_concurrency, "
            "queue_full, ttft_predicted, ttft_expired, quota_unavailable, too_long).",
            ["tenant", "reason"], registry=self.registry)
        self.tokens = Counter(
            "splitserve_gateway_served_tokens", "Tokens served, by tenant and kind.",
            ["tenant", "kind"], registry=self.registry)
        self.ttft = Histogram(
            "splitserve_gateway_ttft_seconds", "Admission to first token, per tenant.",
            ["model", "tenant"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.queue_wait = Histogram(
            "splitserve_gateway_queue_wait_seconds", "Time in the fair queue.",
            ["model", "tenant"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.registry.register(_StateCollector(self))


class _StateCollector:
    def __init__(self, metrics: AdmissionMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        admission = self.metrics.admission
        if admission is None:
            return
        depth = GaugeMetricFamily("splitserve_gateway_queued_requests",
                                  "Requests waiting in the fair queue.", labels=["tenant"])
        counter = GaugeMetricFamily("splitserve_gateway_virtual_token_counter",
                                    "Weighted service received (fair queue).", labels=["tenant"])
        shares = admission.queue.by_tenant()
        for name in admission.directory.tenants:
            waiting, served = shares.get(name, (0, 0.0))
            depth.add_metric([name], waiting)
            counter.add_metric([name], served)
        yield depth
        yield counter
        yield GaugeMetricFamily("splitserve_gateway_inflight_requests",
                                "Requests released to workers and not finished.",
                                value=admission.inflight)
        yield GaugeMetricFamily("splitserve_gateway_inflight_limit",
                                "Most requests released at once now, the decode workers' pace "
                                "under --tpot-target-s included (0: no limit).",
                                value=admission.room.inflight_limit())
        status = admission.quotas.status
        yield GaugeMetricFamily("splitserve_gateway_quota_shared",
                                "1: quotas are shared through Redis; 0: local to this gateway.",
                                value=int(status.shared))
        yield GaugeMetricFamily("splitserve_gateway_quota_replicas",
                                "Gateways sharing the quotas (last Redis heartbeat).",
                                value=status.replicas)
        yield CounterMetricFamily("splitserve_gateway_quota_redis_outages",
                                  "Times Redis became unreachable for quotas.",
                                  value=status.outages)
        yield CounterMetricFamily("splitserve_gateway_quota_fail_open_admissions",
                                  "Requests admitted on local limits while Redis was away.",
                                  value=status.fail_open_admissions)
        estimator = admission.estimator
        yield GaugeMetricFamily("splitserve_gateway_drain_requests_per_second",
                                "Measured rate the cluster takes queued requests.",
                                value=estimator.requests_per_s or 0.0)
        yield GaugeMetricFamily("splitserve_gateway_service_seconds",
                                "Average release -> first token.",
                                value=estimator.service_s or 0.0)
        yield GaugeMetricFamily("splitserve_gateway_ttft_seconds_per_prompt_token",
                                "What one more prompt token to prefill adds to a first token "
                                "(the TTFT estimate's fitted slope).",
                                value=estimator.seconds_per_prompt_token())
        yield GaugeMetricFamily("splitserve_gateway_ttft_seconds_per_extra_choice",
                                "What one more choice beyond a request's first (n > 1) adds to "
                                "a first token (the TTFT estimate's fitted term).",
                                value=estimator.seconds_per_extra_choice())
