"""Per-request latencies and counts of a worker (time to first token, inter-token gaps,
end-to-end time, queue time, prompt and generated tokens, outcomes), measured once per request
as its outputs leave the engine and written into every family set that asks for them (ours and
the vLLM-named ones), so the sets hold the same observations. vLLM's set also breaks each
finished request into its phases and sizes (PhaseFamilies), which ours does not repeat.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Container, Sequence
from dataclasses import dataclass

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from engine.outputs import RequestOutput

log = logging.getLogger(__name__)

# Outcome label values: the engine's finish reasons, and "abort" for a request that left
# without finishing (its caller cancelled, its reader fell behind, its KV never came).
FINISH_REASONS = ("stop", "length", "abort", "error")
# Where a request's prompt tokens came from, as vLLM labels them: computed here, found in this
# worker's prefix cache, or brought by a KV transfer (a decode worker's prompts).
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# How often requests that left without a final output are looked for.
PRUNE_INTERVAL_S = 1.0


class TokenGapHistogram:
    """A histogram observed once per request and step (the inter-token gaps), so kept cheap:
    one bisect and two additions on the engine thread, no lock. Registered as a collector, it
    exports the counts under each of `names`; a scrape may see an observation in a bucket
    before it is in the sum, never a count that goes down."""

    def __init__(self, names: Sequence[str], doc: str, labelnames: Sequence[str],
                 labelvalues: Sequence[str], buckets: Sequence[float]) -> None:
        self.names, self.doc = list(names), doc
        self.labelnames, self.labelvalues = list(labelnames), list(labelvalues)
        self.upper = [float(b) for b in buckets]
        self.counts = [0] * (len(self.upper) + 1)  # the last one is +Inf's own
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.upper, seconds)] += 1
        self.sum += seconds

    def describe(self):
        return []

    def collect(self):
        counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        for upper, count in zip([*self.upper, float("inf")], counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(upper), cumulative))
        for name in self.names:
            family = HistogramMetricFamily(name, self.doc, labels=self.labelnames)
            family.add_metric(self.labelvalues, buckets, total)
            yield family


@dataclass(frozen=True)
class PhaseFamilies:
    """vLLM's breakdown of a finished request, as its v1 engine observes it: the phases from
    the first scheduled step (queue time ends there), and its sizes. Histogram children."""

    prefill: object  # first scheduled -> first output token
    decode: object  # first -> last output token
    inference: object  # first scheduled -> last output token
    time_per_output_token: object  # decode / (tokens generated here - 1); 0 for one token
    prompt_tokens: object  # the request's prompt length
    generation_tokens: object  # the tokens this worker generated for it
    computed_prompt_tokens: object  # its prompt tokens computed here (neither cached nor sent)


@dataclass(frozen=True)
class RequestFamilies:
    """Label-bound prometheus_client children of one naming convention."""

    ttft: object  # Histogram child: arrival -> first output token
    token_gaps: TokenGapHistogram  # gap before each later output
    e2e: object  # Histogram child: arrival -> final output
    queue: object  # Histogram child: arrival -> first scheduled (or first KV-borne token)
    prompt_tokens: object  # Counter child
    generation_tokens: object  # Counter child
    outcomes: dict  # finish reason -> Counter child
    prompt_sources: dict | None = None  # PROMPT_SOURCES -> Counter child (vLLM's set only)
    prompt_cached: object = None  # Counter child: local_cache_hit + external_kv_transfer
    phases: PhaseFamilies | None = None  # (vLLM's set only)
    step_tokens: object = None  # Histogram child: tokens per engine step (vLLM's set only)


@dataclass
class _Open:
    arrived: float  # time.monotonic()
    arrived_ns: int  # time.time_ns(), to compare with the engine's first_scheduled_ns
    first_token: float | None = None
    last_token: float | None = None
    queue_s: float | None = None
    generated: int = 0  # output tokens this worker produced
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    prompt_counted: bool = False


class RequestTimings:
    """Engine thread only: EngineLoop calls `opened` when a request is added and `outputs`
    with each batch of outputs before handing them over. The families it feeds are read by
    the scrape thread (prometheus_client locks its own values). Never raises into the engine
    loop: a failure is logged and the request's figures are lost, nothing else."""

    def __init__(self, families: Sequence[RequestFamilies]) -> None:
        self.families = list(families)
        self._open: dict[str, _Open] = {}
        self._next_prune = 0.0

    @property
    def num_open(self) -> int:
        return len(self._open)

    def opened(self, request_id: str, arrived: float) -> None:
        # Both clocks are read now; the monotonic arrival came from the caller's event loop,
        # and the wall-clock one is set back by the same wait.
        lag_ns = int((time.monotonic() - arrived) * 1e9)
        self._open[request_id] = _Open(arrived, time.time_ns() - max(lag_ns, 0))

    def outputs(self, outputs: Sequence[RequestOutput], live: Container[str]) -> None:
        """`live`: ids of requests that still have a reader (the engine loop's streams)."""
        try:
            now = time.monotonic()
            prompt_tokens = generation_tokens = 0
            sources = dict.fromkeys(PROMPT_SOURCES, 0)
            for out in outputs:
                record = self._open.get(out.request_id)
                if record is not None:
                    prompt_tokens += self._observe(out, record, now, sources)
                    generation_tokens += len(out.new_token_ids)
            if generation_tokens or prompt_tokens:  # counters once per batch, not per request
                for f in self.families:
                    f.prompt_tokens.inc(prompt_tokens)
                    f.generation_tokens.inc(generation_tokens)
                    if f.prompt_sources is not None and prompt_tokens:
                        for source, count in sources.items():
                            f.prompt_sources[source].inc(count)
                        f.prompt_cached.inc(prompt_tokens - sources["local_compute"])
            if now >= self._next_prune:
                self._next_prune = now + PRUNE_INTERVAL_S
                self._prune(live)
        except Exception:
            log.exception("request metrics: a batch of outputs was not recorded")

    def _observe(self, out: RequestOutput, record: _Open, now: float,
                 sources: dict[str, int]) -> int:
        """Records one output; returns the prompt tokens it brings to the count (on its
        request's first token), adding them to `sources` by where they came from."""
        prompt_tokens = 0
        served = out.finished and out.error is None and out.finish_reason in ("stop", "length")
        if not record.prompt_counted and (out.new_token_ids or served):
            # On its first token, or its end without one here (a decode worker's request
            # whose only token came from the prefill worker: its prompt went uncounted).
            record.prompt_counted = True
            prompt_tokens = out.num_prompt_tokens
            # A decode worker's prompt tokens whose KV it held already are cache hits, not
            # transfers (they were counted as sent).
            cached = min(max(out.num_cached_tokens, out.kv_reused_tokens), prompt_tokens)
            sources["local_cache_hit"] += cached
            remote = out.kv_arrived_ns is not None  # its KV came from a prefill worker
            sources["external_kv_transfer" if remote else "local_compute"] += (
                prompt_tokens - cached)
            record.prompt_tokens = prompt_tokens
            record.computed_prompt_tokens = 0 if remote else prompt_tokens - cached
        if out.new_token_ids:
            if record.first_token is None:
                record.first_token = now
                record.queue_s = self._queue_s(out, record, now)
                for f in self.families:
                    f.ttft.observe(now - record.arrived)
            else:
                gap = now - record.last_token
                for f in self.families:
                    f.token_gaps.observe(gap)
            record.last_token = now
            record.generated += len(out.new_token_ids)
        if out.finished:
            del self._open[out.request_id]
            reason = out.finish_reason if out.finish_reason in FINISH_REASONS else "error"
            if out.error:
                reason = "error"
            for f in self.families:
                f.outcomes[reason].inc()
                if reason != "error":
                    f.e2e.observe(now - record.arrived)
                    queue_s = record.queue_s if record.queue_s is not None else now - record.arrived
                    f.queue.observe(queue_s)
                    if f.phases is not None:
                        _observe_phases(f.phases, record, queue_s, now, out.num_prompt_tokens)
        return prompt_tokens

    @staticmethod
    def _queue_s(out: RequestOutput, record: _Open, now: float) -> float:
        # With remote KV the first scheduled step comes after the KV arrived, so the wait for
        # it is queue time (vLLM counts requests waiting for remote KV as waiting too); an
        # output never scheduled here counts its whole wait.
        if out.first_scheduled_ns is None:
            return now - record.arrived
        return max(out.first_scheduled_ns - record.arrived_ns, 0) / 1e9

    def _prune(self, live: Container[str]) -> None:
        """Requests that left without a final output (aborted, cut off) count as "abort"."""
        gone = [rid for rid in self._open if rid not in live]
        for rid in gone:
            del self._open[rid]
            for f in self.families:
                f.outcomes["abort"].inc()


def _observe_phases(phases: PhaseFamilies, record: _Open, queue_s: float, now: float,
                    num_prompt_tokens: int) -> None:
    scheduled = record.arrived + queue_s
    first = record.first_token if record.first_token is not None else now
    last = record.last_token if record.last_token is not None else now
    decode_s = last - first
    phases.prefill.observe(max(first - scheduled, 0.0))
    phases.decode.observe(decode_s)
    phases.inference.observe(max(last - scheduled, 0.0))
    phases.time_per_output_token.observe(
        decode_s / (record.generated - 1) if record.generated > 1 else 0.0)
    phases.prompt_tokens.observe(record.prompt_tokens or num_prompt_tokens)
    phases.generation_tokens.observe(record.generated)
    phases.computed_prompt_tokens.observe(record.computed_prompt_tokens)
