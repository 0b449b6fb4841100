"""Per-request latencies and counts of a worker (time to first token, inter-token gaps,
end-to-end time, queue time, prompt and generated tokens, outcomes), measured once per request
as its outputs leave the engine and written into every family set that asks for them (ours and
the vLLM-named ones), so the sets hold the same observations.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass

from engine.outputs import RequestOutput

log = logging.getLogger(__name__)

# Outcome label values: the engine's finish reasons, and "abort" for a request that left
# without finishing (its caller cancelled, its reader fell behind, its KV never came).
FINISH_REASONS = ("stop", "length", "abort", "error")
# How often requests that left without a final output are looked for.
PRUNE_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RequestFamilies:
    """Label-bound prometheus_client children of one naming convention."""

    ttft: object  # Histogram child: arrival -> first output token
    token_gaps: Sequence[object]  # Histogram children: gap before each later output
    e2e: object  # Histogram child: arrival -> final output
    queue: object  # Histogram child: arrival -> first scheduled (or first KV-borne token)
    prompt_tokens: object  # Counter child
    generation_tokens: object  # Counter child
    outcomes: dict  # finish reason -> Counter child


@dataclass
class _Open:
    arrived: float  # time.monotonic()
    arrived_ns: int  # time.time_ns(), to compare with the engine's first_scheduled_ns
    first_token: float | None = None
    last_token: float | None = None
    queue_s: float | None = None


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
            for out in outputs:
                record = self._open.get(out.request_id)
                if record is not None:
                    self._observe(out, record, now)
            if now >= self._next_prune:
                self._next_prune = now + PRUNE_INTERVAL_S
                self._prune(live)
        except Exception:
            log.exception("request metrics: a batch of outputs was not recorded")

    def _observe(self, out: RequestOutput, record: _Open, now: float) -> None:
        if out.new_token_ids:
            if record.first_token is None:
                record.first_token = now
                record.queue_s = self._queue_s(out, record, now)
                for f in self.families:
                    f.ttft.observe(now - record.arrived)
                    f.prompt_tokens.inc(out.num_prompt_tokens)
            else:
                for f in self.families:
                    for gaps in f.token_gaps:
                        gaps.observe(now - record.last_token)
            record.last_token = now
            for f in self.families:
                f.generation_tokens.inc(len(out.new_token_ids))
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

    @staticmethod
    def _queue_s(out: RequestOutput, record: _Open, now: float) -> float:
        # A request whose KV came from a prefill worker is never scheduled before its first
        # token: its wait for the KV is its queue time (vLLM counts requests waiting for
        # remote KV as waiting too).
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
