"""The worker's metrics again under vLLM's names, labels (`model_name`, `engine`) and buckets,
so vLLM dashboards and the Gateway API Inference Extension's endpoint picker read splitserve
workers as they read vLLM. Same sources as ours: the engine stats at scrape time, and the
observations of services/common/request_timing.py. On unless the worker runs --no-vllm-metrics.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.request_timing import (
    FINISH_REASONS,
    PROMPT_SOURCES,
    PhaseFamilies,
    RequestFamilies,
)

LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine per worker process (vLLM numbers its data-parallel engines)
# vLLM's own bucket boundaries (vllm/v1/metrics/loggers.py); all reach past 20 minutes but ITL.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens per engine step: powers of two to a large step budget.
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def request_token_buckets(max_model_len: int) -> list[int]:
    """Tokens of a request: 1, 2, 5, 10, 20, 50, ... up to the context length (vLLM's series)."""
    bounds, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return bounds or [1]
            bounds.append(step * scale)
        scale *= 10


def register_vllm_metrics(metrics, max_model_len: int) -> RequestFamilies:
    """Register the vLLM-named families on `metrics.registry` (a WorkerMetrics) and return the
    request families for its RequestTimings to feed (and the per-step histogram)."""
    registry, values = metrics.registry, (metrics.model, ENGINE_INDEX)
    registry.register(_VllmStatsCollector(metrics))

    def histogram(name: str, doc: str, buckets) -> Histogram:
        return Histogram(name, doc, LABELS, buckets=buckets, registry=registry).labels(*values)

    def counter(name: str, doc: str) -> Counter:
        return Counter(name, doc, LABELS, registry=registry).labels(*values)

    success = Counter("vllm:request_success",
                      "Requests that left this worker, by finished_reason.",
                      [*LABELS, "finished_reason"], registry=registry)
    # Disaggregated, a prompt counts on its prefill worker and again on its decode worker (as
    # in vLLM's P/D); by source, the decode worker's are external_kv_transfer.
    by_source = Counter("vllm:prompt_tokens_by_source",
                        "Prompt tokens by source: local_compute, local_cache_hit, "
                        "external_kv_transfer.", [*LABELS, "source"], registry=registry)
    return RequestFamilies(
        ttft=histogram("vllm:time_to_first_token_seconds",
                       "Arrival at this worker to its first output token.", TTFT_BUCKETS),
        # vLLM observes both once per engine step that gave the request tokens: one set of
        # counts under both names (the second is the older one dashboards still read).
        token_gaps=metrics.token_gap_histogram(
            ["vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"],
            "Gap before each later output of a request.", LABELS, values, TOKEN_GAP_BUCKETS),
        e2e=histogram("vllm:e2e_request_latency_seconds",
                      "Arrival to the final output of a finished request.", REQUEST_LATENCY_BUCKETS),
        queue=histogram("vllm:request_queue_time_seconds",
                        "Arrival to first scheduled step (with remote KV: to the KV's "
                        "first token).",
                        REQUEST_LATENCY_BUCKETS),
        prompt_tokens=counter("vllm:prompt_tokens",
                              "Prompt tokens of requests that reached their first token."),
        generation_tokens=counter("vllm:generation_tokens",
                                  "Output tokens sent by this worker."),
        outcomes={r: success.labels(*values, r) for r in FINISH_REASONS},
        prompt_sources={s: by_source.labels(*values, s) for s in PROMPT_SOURCES},
        prompt_cached=counter("vllm:prompt_tokens_cached",
                              "Prompt tokens not computed here (local + external cache)."),
        phases=_phase_families(histogram, request_token_buckets(max_model_len)),
        step_tokens=histogram("vllm:iteration_tokens_total",
                              "Tokens run through the model in one engine step.",
                              STEP_TOKEN_BUCKETS))


def _phase_families(histogram, token_buckets) -> PhaseFamilies:
    return PhaseFamilies(
        prefill=histogram("vllm:request_prefill_time_seconds",
                          "First scheduled step to the first output token of a finished "
                          "request.", REQUEST_LATENCY_BUCKETS),
        decode=histogram("vllm:request_decode_time_seconds",
                         "First to last output token of a finished request.",
                         REQUEST_LATENCY_BUCKETS),
        inference=histogram("vllm:request_inference_time_seconds",
                            "First scheduled step to the last output token of a finished "
                            "request.", REQUEST_LATENCY_BUCKETS),
        time_per_output_token=histogram(
            "vllm:request_time_per_output_token_seconds",
            "A finished request's decode time over its output tokens after the first made "
            "here (0 for one token).", TOKEN_GAP_BUCKETS),
        prompt_tokens=histogram("vllm:request_prompt_tokens",
                                "Prompt tokens of a finished request.", token_buckets),
        generation_tokens=histogram("vllm:request_generation_tokens",
                                    "Output tokens this worker generated for a finished "
                                    "request.", token_buckets),
        computed_prompt_tokens=histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prompt tokens of a finished request computed here (not cached, not received).",
            token_buckets))


class _VllmStatsCollector:
    """Scheduler and cache state under vLLM's names, read from the engine loop's stats."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        loop = self.metrics.engine_loop
        if loop is None:
            return
        stats = loop.stats
        values = [self.metrics.model, ENGINE_INDEX]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            family.add_metric(values, float(value))
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(values, float(value))
            return family

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", stats["running"])
        # vLLM's waiting queue holds the requests waiting for remote KV (and for blocks to
        # receive it in) as well.
        yield gauge("vllm:num_requests_waiting", "Requests queued for prefill, for free KV "
                    "blocks, or for their KV from a prefill worker.",
                    stats["waiting"] + stats["waiting_for_kv"]
                    + stats.get("reservations_waiting", 0))
        total = stats["kv_blocks_total"]
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).",
                    (total - stats["kv_blocks_free"]) / max(total, 1))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats["prefix_queries"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats["prefix_hits"])
        yield counter("vllm:num_preemptions", "Requests preempted for lack of KV blocks.", stats["preemptions"])
