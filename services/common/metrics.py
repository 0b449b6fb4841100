"""Prometheus metrics of a worker process.

Gauges and counters that mirror engine state are read at scrape time from the engine loop's
stats snapshot (nothing on the hot path); histograms are observed once per engine step on the
engine thread and once per KV transfer on kv_transfer threads.
"""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.common.request_timing import (
    FINISH_REASONS,
    RequestFamilies,
    RequestTimings,
    TokenGapHistogram,
)
from services.common.vllm_metrics import register_vllm_metrics

# Sub-second latencies dominate; the tail reaches seconds on CPU.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.0, 5.0, 10.0)
LABELS = ("model", "role")
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# Time to first token and queue time (gateway and workers): sub-second when served, minutes
# under overload; out to 20 minutes so an overloaded p99 does not pin at the top bucket.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
                20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0)
# A whole request (gateway and workers): seconds to 20 minutes.
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0,
               60.0, 120.0, 300.0, 600.0, 1200.0)


def process_registry() -> CollectorRegistry:
    """A registry holding the series every Prometheus client library exports by default, as
    vLLM's registry does: the process's (process_resident_memory_bytes, process_cpu_seconds_total,
    process_open_fds, process_max_fds), the platform's and the garbage collector's."""
    registry = CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    return registry


class WorkerMetrics:
    def __init__(self, role: str, worker_id: str, *, model: str = "",
                 vllm_metrics: bool = True, max_model_len: int = 32768) -> None:
        self.registry = process_registry()
        self.role = role
        self.worker_id = worker_id
        self.model = model
        self.engine_loop = None
        self.kv_stats = []  # kv_transfer.KVStats objects (receiver and/or sender pool)
        # Every worker series carries the served model's name beside the role.
        labels, values = LABELS, (model, role)
        self.step_seconds = Histogram(
            "splitserve_worker_step_seconds", "Wall time of one engine step.", labels,
            buckets=LATENCY_BUCKETS, registry=self.registry).labels(*values)
        self.batch_size = Histogram(
            "splitserve_worker_batch_size_requests", "Requests scheduled in one engine step.",
            labels, buckets=SIZE_BUCKETS, registry=self.registry).labels(*values)
        self.batched_tokens = Histogram(
            "splitserve_worker_batched_tokens", "Tokens run through the model in one step.",
            labels, buckets=SIZE_BUCKETS, registry=self.registry).labels(*values)
        self.kv_transfer_seconds = Histogram(
            "splitserve_kv_transfer_seconds", "Time to move one request's KV.", labels,
            buckets=LATENCY_BUCKETS, registry=self.registry).labels(*values)
        self.registry.register(_StatsCollector(self))
        families = [self._request_families()]
        if vllm_metrics:
            families.append(register_vllm_metrics(self, max_model_len))
        self.requests = RequestTimings(families)

    def _request_families(self) -> RequestFamilies:
        labels, values = LABELS, (self.model, self.role)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry).labels(*values)

        outcomes = Counter("splitserve_worker_requests", "Requests that left this worker, by "
                           "finish reason (stop, length, abort, error).",
                           [*labels, "finish_reason"], registry=self.registry)
        return RequestFamilies(
            ttft=histogram("splitserve_worker_ttft_seconds",
                           "Arrival at this worker to its first output token.", TTFT_BUCKETS),
            token_gaps=self.token_gap_histogram(["splitserve_worker_itl_seconds"],
                                        "Gap before each later output of a request (one per "
                                        "step; a step may carry several speculative tokens).",
                                        labels, values, LATENCY_BUCKETS),
            e2e=histogram("splitserve_worker_e2e_latency_seconds",
                          "Arrival at this worker to the final output of a finished request.",
                          E2E_BUCKETS),
            queue=histogram("splitserve_worker_queue_time_seconds",
                            "Arrival to first scheduled step (or, with remote KV, to the KV's "
                            "first token), of a finished request.", TTFT_BUCKETS),
            prompt_tokens=counter("splitserve_worker_prompt_tokens",
                                  "Prompt tokens of requests that reached their first token."),
            generation_tokens=counter("splitserve_worker_generation_tokens",
                                      "Output tokens sent by this worker."),
            outcomes={r: outcomes.labels(*values, r) for r in FINISH_REASONS})

    def token_gap_histogram(self, names, doc, labels, values, buckets) -> TokenGapHistogram:
        """A TokenGapHistogram on this registry, exported under each of `names`."""
        gaps = TokenGapHistogram(names, doc, labels, values, buckets)
        self.registry.register(gaps)
        return gaps

    def attach(self, engine_loop) -> None:
        """Read `engine_loop`'s stats at scrape time; observe its steps and requests."""
        self.engine_loop = engine_loop
        engine_loop.on_step = self.observe_step
        engine_loop.on_open = self.requests.opened
        engine_loop.on_outputs = self.requests.outputs

    def observe_step(self, seconds: float, num_requests: int, num_tokens: int) -> None:
        self.step_seconds.observe(seconds)
        self.batch_size.observe(num_requests)
        self.batched_tokens.observe(num_tokens)
        for families in self.requests.families:
            if families.step_tokens is not None:
                families.step_tokens.observe(num_tokens)


class _StatsCollector:
    """Exports the engine's and kv_transfer's counters as they are at scrape time."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        m = self.metrics
        labels = (m.model, m.role)  # of every series
        loop = m.engine_loop
        if loop is not None:
            stats = loop.stats
            gauges = {
                "splitserve_worker_running_requests": ("running", "Requests in the running batch."),
                "splitserve_worker_waiting_requests": ("waiting", "Requests queued for prefill."),
                "splitserve_worker_waiting_for_kv_requests":
                    ("waiting_for_kv", "Requests with reserved blocks awaiting remote KV."),
                "splitserve_worker_waiting_for_blocks_requests":
                    ("reservations_waiting", "Remote-KV requests waiting for free KV blocks "
                     "to reserve."),
                "splitserve_kv_blocks_total": ("kv_blocks_total", "KV cache blocks."),
                "splitserve_worker_queued_prefill_tokens":
                    ("queued_prefill_tokens", "Prompt tokens waiting to be computed."),
            }
            for name, (key, doc) in gauges.items():
                yield _gauge(name, doc, labels, stats[key])
            yield _gauge("splitserve_worker_token_interval_seconds", "Mean gap between steps "
                         "per token over the last 3 s while requests ran (0 until they ran for "
                         "1 s of it): the streams' time per token.",
                         labels, stats.get("token_interval_s", 0.0))
            used = stats["kv_blocks_total"] - stats["kv_blocks_free"]
            yield _gauge("splitserve_kv_blocks_used", "KV cache blocks in use.", labels, used)
            yield _gauge("splitserve_kv_usage_ratio", "Fraction of KV blocks in use.", labels,
                         used / max(stats["kv_blocks_total"], 1))
            yield _gauge("splitserve_worker_healthy", "1 while the engine loop runs.", labels,
                         1.0 if loop.healthy else 0.0)
            yield _gauge("splitserve_worker_step_stalled",
                         "1 while an engine step runs past --step-timeout-s.", labels,
                         1.0 if loop.stalled else 0.0)
            counters = {
                "splitserve_prefix_cache_queries_tokens": ("prefix_queries", "Prompt tokens looked up in the prefix cache."),
                "splitserve_prefix_cache_hits_tokens": ("prefix_hits", "Prompt tokens found in the prefix cache."),
                "splitserve_preemptions": ("preemptions", "Requests preempted for lack of KV blocks."),
                "splitserve_worker_computed_tokens": ("computed_tokens", "Tokens run through the model."),
                "splitserve_worker_steps": ("steps", "Engine steps that ran the model."),
            }
            for name, (key, doc) in counters.items():
                yield _counter(name, doc, labels, stats[key])
            share = loop.core_share
            if share is not None:  # services/common/core_share.py
                yield _gauge("splitserve_worker_step_threads", "Torch threads of the latest step "
                             "(its own and those borrowed from idle co-located workers).", labels,
                             loop.step_threads)
                yield _counter("splitserve_worker_core_share_waits", "Steps that waited for a "
                               "co-located worker to hand borrowed cores back.", labels, share.waits)
                yield _counter("splitserve_worker_core_share_wait_seconds", "Time steps waited "
                               "for borrowed cores to come back.", labels, share.wait_seconds)
                yield _counter("splitserve_worker_core_share_yields", "Steps that paused while "
                               "a co-located prefill worker stepped.", labels, share.yields)
                yield _counter("splitserve_worker_core_share_yield_seconds", "Time steps paused "
                               "for a co-located prefill worker's steps.", labels,
                               share.yield_seconds)
            for key, value in stats.items():
                if key.startswith("spec_"):
                    yield _counter(f"splitserve_{key}", "Speculative decoding tokens.", labels, value)
        if m.kv_stats:
            snaps = [s.snapshot() for s in m.kv_stats]
            yield _counter("splitserve_kv_transfer_bytes", "KV bytes moved.", labels,
                           sum(s.bytes for s in snaps))
            yield _counter("splitserve_kv_transfer_shared_memory_bytes", "KV bytes that crossed "
                           "a shared-memory region (prefill and decode on one host); the rest "
                           "went over gloo or NCCL.", labels, sum(s.shared_bytes for s in snaps))
            yield _counter("splitserve_kv_transfers", "KV transfers completed.", labels,
                           sum(s.transfers for s in snaps))
            yield _counter("splitserve_kv_transfer_failures", "KV transfers that failed.", labels,
                           sum(s.failures + s.failed_transfers for s in snaps))
            yield _counter("splitserve_kv_transfer_queue_full", "KV sends that found their "
                           "decode worker's queue full (--max-queued-kv-transfers) and waited.",
                           labels, sum(s.rejected for s in snaps))
            yield _counter("splitserve_kv_transfer_dropped", "KV received for dead requests.",
                           labels, sum(s.dropped for s in snaps))
            yield _counter("splitserve_kv_frames_refused", "KV frames refused (bad header, tag "
                           "or fields; the request recomputes).", labels,
                           sum(s.refused_frames for s in snaps))
            yield _counter("splitserve_kv_auth_failures", "KV channels closed: the peer did not "
                           "prove the cluster secret.", labels, sum(s.auth_failures for s in snaps))


def _gauge(name: str, doc: str, labels: tuple[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, float(value))
    return family


def _counter(name: str, doc: str, labels: tuple[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=LABELS)
    family.add_metric(labels, float(value))
    return family
