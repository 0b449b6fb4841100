"""The planner's input: a DemandSample (token arrival rates, backlogs, KV use, ready replicas)
and the conversion from worker stats (the Redis registry, or the same counters scraped from
Prometheus) into one. A gateway with arrival counters can build DemandSamples directly.

Arrival rates come from counter deltas: what a pool computed plus how much its queue grew, so
a saturated pool still shows the demand it is not keeping up with.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.common.registry import WorkerInfo


@dataclass(frozen=True)
class DemandSample:
    """Load at one moment. Rates are per second; gauges are pool totals."""

    time: float
    prompt_tokens_per_s: float  # prompt tokens arriving for prefill (computed + queue growth)
    output_tokens_per_s: float  # output tokens the decode pool produces
    queued_prefill_tokens: float = 0.0  # prompt tokens waiting in prefill queues
    decode_sequences: float = 0.0  # running + waiting (for KV, for blocks or a slot) on decode
    decode_waiting_for_kv: float = 0.0  # of those, reserved and still being prefilled
    kv_blocks_used: float = 0.0
    kv_blocks_total: float = 0.0
    prefill_ready: int = 0  # registered, not draining
    decode_ready: int = 0
    mean_prompt_tokens: float | None = None  # None: use the configured length mix
    mean_context_tokens: float | None = None  # tokens per decoding sequence (from KV use)
    block_size: int = 16

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass
class _Seen:
    updated: float
    computed: float
    queued: float
    prompt_rate: float = 0.0
    output_rate: float = 0.0


class WorkerStatsRates:
    """Turns successive lists of WorkerInfo (registry snapshots) into DemandSamples.

    Each worker's counters are differenced against its own previous heartbeat, so workers that
    join, leave or restart (counters back to 0) never produce a negative or a phantom rate.
    Owned by whoever calls update() (the control loop's thread)."""

    def __init__(self) -> None:
        self._seen: dict[str, _Seen] = {}

    def update(self, now: float, workers: Iterable[WorkerInfo]) -> DemandSample:
        prompt_rate = output_rate = queued = sequences = awaiting_kv = used = total = 0.0
        ready = {"prefill": 0, "decode": 0}
        block_size = 16
        seen: dict[str, _Seen] = {}
        for info in workers:
            if info.draining or info.role not in ("prefill", "decode"):
                continue
            stats = info.stats
            ready[info.role] += 1
            computed = float(stats.get("computed_tokens", 0))
            waiting = float(stats.get("queued_prefill_tokens", 0))
            current = _Seen(info.updated or now, computed, waiting)
            before = self._seen.get(info.worker_id)
            if before is not None and computed >= before.computed:
                dt = current.updated - before.updated
                if dt > 0:
                    current.prompt_rate = max(0.0, (computed - before.computed + waiting
                                                    - before.queued) / dt)
                    current.output_rate = (computed - before.computed) / dt
                else:  # no new heartbeat since last time: keep the last rate
                    current.prompt_rate, current.output_rate = before.prompt_rate, before.output_rate
            seen[info.worker_id] = current
            if info.role == "prefill":
                prompt_rate += current.prompt_rate
                queued += waiting
            else:
                output_rate += current.output_rate
                sequences += sum(float(stats.get(k, 0)) for k in (
                    "running", "waiting", "waiting_for_kv", "reservations_waiting"))
                awaiting_kv += float(stats.get("waiting_for_kv", 0))
                free = float(stats.get("kv_blocks_free", 0))
                total += float(stats.get("kv_blocks_total", 0))
                used += float(stats.get("kv_blocks_total", 0)) - free
                block_size = info.block_size or block_size
        self._seen = seen
        context = used * block_size / sequences if sequences else None
        return DemandSample(
            time=now, prompt_tokens_per_s=prompt_rate, output_tokens_per_s=output_rate,
            queued_prefill_tokens=queued, decode_sequences=sequences,
            decode_waiting_for_kv=awaiting_kv, kv_blocks_used=used,
            kv_blocks_total=total, prefill_ready=ready["prefill"], decode_ready=ready["decode"],
            mean_context_tokens=context, block_size=block_size,
        )
