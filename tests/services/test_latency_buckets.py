"""Time-to-first-token, queue-time and end-to-end histograms (the gateway's, the workers' and the
vLLM-named ones) reach 20 minutes: a request that waited 15 minutes under overload lands in a
finite bucket, so p99 is not pinned at the top one. Real registries, read back through the
Prometheus text format."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.common.metrics import WorkerMetrics
from services.gateway.admission.metrics import AdmissionMetrics
from services.gateway.request_metrics import RequestMetrics

OVERLOADED_S = 15 * 60


def worker_histograms():
    metrics = WorkerMetrics("decode", "w0", model="m")
    for family in metrics.requests.families:  # ours and the vLLM-named ones
        for histogram in (family.ttft, family.queue, family.e2e):
            histogram.observe(OVERLOADED_S)
    return metrics.registry, {
        "splitserve_worker_ttft_seconds", "splitserve_worker_queue_time_seconds",
        "splitserve_worker_e2e_latency_seconds", "vllm:time_to_first_token_seconds",
        "vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"}


def gateway_histograms():
    admission = AdmissionMetrics()
    requests = RequestMetrics(admission.registry)
    for histogram in (admission.ttft, admission.queue_wait, requests.e2e):
        histogram.labels("m", "t").observe(OVERLOADED_S)
    return admission.registry, {"splitserve_gateway_ttft_seconds",
                                "splitserve_gateway_queue_wait_seconds",
                                "splitserve_gateway_e2e_latency_seconds"}


def buckets(registry: CollectorRegistry) -> dict[str, list[tuple[float, float]]]:
    """Histogram name -> [(upper bound, cumulative count)] of its one labelled series."""
    found: dict[str, list[tuple[float, float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                found.setdefault(family.name, []).append((float(sample.labels["le"]),
                                                          sample.value))
    return found


@pytest.mark.parametrize("build", [worker_histograms, gateway_histograms])
def test_fifteen_minute_waits_land_in_a_finite_bucket(build) -> None:
    registry, names = build()
    found = buckets(registry)
    assert names <= set(found), names - set(found)
    for name in names:
        finite = [(le, count) for le, count in found[name] if le != float("inf")]
        assert finite[-1][0] >= 20 * 60, (name, finite[-1])
        # The observation is counted below +Inf, and not in the bucket of a few minutes.
        assert any(count == 1 for _, count in finite), name
        assert [count for le, count in finite if le <= 300] == [0] * sum(
            le <= 300 for le, _ in finite), name
