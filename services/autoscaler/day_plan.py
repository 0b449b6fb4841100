"""A capacity study over one day of traffic: the rate over the day (a diurnal curve and a short
spike), the replicas each policy keeps hour by hour, GPU-hours and cost per 1,000 queries, KV
memory per decode replica, KV-transfer bandwidth against link capacities, and what one lost
replica or one lost zone does at the peak. Pure arithmetic on `capacity.py`; no simulation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.autoscaler.capacity import (
    SLO,
    CapacityModel,
    CapacityPlan,
    WorkloadShape,
    plan_for_rate,
)
from services.autoscaler.profile import HardwareProfile

DAY_S = 86400.0

# One direction, per GPU, line rate (what a prefill GPU can push to the decode side).
LINKS: dict[str, tuple[float, str]] = {
    "nvlink": (450e9, "NVLink 4 (H100/H200 SXM, same node): 450 GB/s"),
    "rdma": (50e9, "RDMA, InfiniBand NDR / 400 Gb/s RoCE per GPU: 50 GB/s"),
    "tcp": (12.5e9, "TCP over 100 GbE: 12.5 GB/s"),
}


@dataclass(frozen=True)
class DayShape:
    """Requests/s over a day: a trough-to-peak curve trough + (peak - trough) * bump(t)^sharpness
    (bump = (1 - cos) / 2, highest at peak_at_s) whose mean is queries_per_day / 86400, and a
    spike of spike_factor x that mean for spike_s seconds from spike_at_s (default: at the peak).
    The spike's queries come on top of queries_per_day."""

    queries_per_day: float = 50e6
    peak_factor: float = 3.0  # diurnal peak / daily mean
    spike_factor: float = 10.0  # spike rate / daily mean
    spike_s: float = 60.0
    peak_at_s: float = 14 * 3600.0
    spike_at_s: float | None = None
    sharpness: float = 4.0

    def __post_init__(self) -> None:
        if self.queries_per_day <= 0 or self.peak_factor < 1 or self.spike_s < 0:
            raise ValueError("queries per day must be > 0, peak factor >= 1, spike seconds >= 0")
        if self.spike_factor < 0 or self.sharpness <= 0:
            raise ValueError("spike factor must be >= 0 and sharpness > 0")
        if self.trough_rate < 0:
            raise ValueError(f"a peak of {self.peak_factor:g}x the mean needs a sharper curve than "
                             f"sharpness {self.sharpness:g} (the trough would be negative)")

    @property
    def mean_rate(self) -> float:
        return self.queries_per_day / DAY_S

    @property
    def peak_rate(self) -> float:
        return self.peak_factor * self.mean_rate

    @property
    def spike_rate(self) -> float:
        return self.spike_factor * self.mean_rate

    @property
    def _bump_mean(self) -> float:
        p = self.sharpness  # mean over a period of ((1 - cos x) / 2)^p
        return math.gamma(p + 0.5) / (math.sqrt(math.pi) * math.gamma(p + 1))

    @property
    def trough_rate(self) -> float:
        k = self._bump_mean
        return (self.mean_rate - self.peak_rate * k) / (1 - k)

    @property
    def spike_start_s(self) -> float:
        return self.peak_at_s if self.spike_at_s is None else self.spike_at_s

    def diurnal_rate(self, t: float) -> float:
        bump = (1 + math.cos(2 * math.pi * (t - self.peak_at_s) / DAY_S)) / 2
        return self.trough_rate + (self.peak_rate - self.trough_rate) * bump ** self.sharpness

    def in_spike(self, t: float) -> bool:
        return self.spike_start_s <= t % DAY_S < self.spike_start_s + self.spike_s

    def rate(self, t: float) -> float:
        """Requests/s at t seconds after midnight (wraps at a day)."""
        base = self.diurnal_rate(t)
        return max(base, self.spike_rate) if self.in_spike(t) else base

    def hourly_max(self) -> list[float]:
        """The highest diurnal rate in each hour (minute resolution), spike excluded."""
        return [max(self.diurnal_rate(h * 3600 + m * 60) for m in range(61)) for h in range(24)]


@dataclass(frozen=True)
class PolicyDay:
    name: str
    prefill: tuple[int, ...]  # replicas per hour, spare included
    decode: tuple[int, ...]
    gpu_hours: float
    cost_per_1k: float  # USD per 1,000 queries
    attainment: float  # share of the day's queries arriving while the pool sustains the rate
    one_replica_lost: float  # share of peak demand served with one replica of each role gone
    zone_lost: float  # share of peak demand served with one zone's replicas gone


@dataclass(frozen=True)
class LinkLoad:
    kv_bytes_per_token: float
    prefill_egress_bytes_per_s: float  # one prefill GPU at the peak
    pair_bytes_per_s: float  # one prefill -> decode pair, on average
    prompt_kv_bytes: float  # the KV of a mean prompt
    utilization: dict[str, float]  # prefill egress / link capacity
    prompt_transfer_s: dict[str, float]  # one mean prompt's KV over each link


def cost_per_1k_queries(gpu_hours: float, price_per_gpu_hour: float, queries: float) -> float:
    """USD per 1,000 queries: every replica is one GPU for as long as it is up."""
    if queries <= 0:
        raise ValueError("queries must be > 0")
    return gpu_hours * price_per_gpu_hour / (queries / 1000)


def link_load(profile: HardwareProfile, plan: CapacityPlan) -> LinkLoad:
    """KV bytes moving from prefill to decode at plan.rate, spread over the working replicas
    (spares excluded: they carry the load when one fails)."""
    per_token = profile.kv_bytes_per_block / profile.block_size
    n_prefill = max(plan.prefill_replicas - plan.spare, 1)
    n_decode = max(plan.decode_replicas - plan.spare, 1)
    egress = plan.prompt_tokens_per_s * per_token / n_prefill
    prompt_bytes = plan.shape.mean_prompt_tokens * per_token
    return LinkLoad(per_token, egress, egress / n_decode, prompt_bytes,
                    {name: egress / cap for name, (cap, _) in LINKS.items()},
                    {name: prompt_bytes / cap for name, (cap, _) in LINKS.items()})


def kv_bytes_per_decode_replica(profile: HardwareProfile, plan: CapacityPlan) -> tuple[float, float]:
    """(KV bytes in use on one working decode replica at plan.rate, the replica's KV pool)."""
    n_decode = max(plan.decode_replicas - plan.spare, 1)
    blocks = plan.decode_sequences / n_decode * (profile.blocks_for(plan.shape.mean_decode_context) + 1)
    return blocks * profile.kv_bytes_per_block, profile.kv_blocks * profile.kv_bytes_per_block


def sustained_rate(profile: HardwareProfile, shape: WorkloadShape, slo: SLO, prefill: int,
                   decode: int, model: CapacityModel | None = None) -> float:
    """Requests/s that `prefill` and `decode` replicas sustain within the SLOs."""
    model = model or CapacityModel()
    pre, dec = model.prefill(profile, slo, shape), model.decode(profile, slo, shape)
    by_prefill = prefill * pre.tokens_per_s / shape.mean_prompt_tokens
    by_decode = decode * dec.tokens_per_s / shape.mean_output_tokens
    seq_blocks = profile.blocks_for(shape.mean_decode_context) + 1
    by_kv = decode * dec.kv_blocks / seq_blocks / (shape.mean_output_tokens * dec.step_s)
    return max(0.0, min(by_prefill, by_decode, by_kv))


def zone_survivors(replicas: int, zones: int) -> int:
    """Replicas left when the zone holding the most of them (spread evenly) is lost."""
    if zones <= 1:
        return 0
    return replicas - math.ceil(replicas / zones)


def plan_day(profile: HardwareProfile, day: DayShape, shape: WorkloadShape, slo: SLO,
             price_per_gpu_hour: float, spare: int = 1, zones: int = 3,
             startup_s: float | None = None) -> list[PolicyDay]:
    """Three policies over the day: fixed at the spike, fixed at the diurnal peak, and hourly
    (each hour sized for its highest rate: what a planner with a good forecast keeps). A
    replica asked for at the spike's start serves after the start-up time, so a spike shorter
    than start-up is met only by what is already running (the hourly policy's GPU-hours leave
    out the replicas it adds for a spike)."""
    hourly = day.hourly_max()
    plans = {
        "fixed-spike": [plan_for_rate(profile, max(day.spike_rate, day.peak_rate), shape, slo, spare)] * 24,
        "fixed-peak": [plan_for_rate(profile, day.peak_rate, shape, slo, spare)] * 24,
        "hourly": [plan_for_rate(profile, rate, shape, slo, spare) for rate in hourly],
    }
    startup = profile.startup_s if startup_s is None else startup_s
    queries = day.queries_per_day + max(0.0, day.spike_rate - day.peak_rate) * day.spike_s
    peak_hour = int(day.peak_at_s // 3600) % 24
    rows = []
    for name, per_hour in plans.items():
        prefill = tuple(p.prefill_replicas for p in per_hour)
        decode = tuple(p.decode_replicas for p in per_hour)
        gpu_hours = float(sum(prefill) + sum(decode))
        sustained = [sustained_rate(profile, shape, slo, p, d) for p, d in zip(prefill, decode, strict=True)]
        served = demand = 0.0
        for minute in range(24 * 60):  # the diurnal curve, a minute at a time
            rate = day.diurnal_rate(minute * 60.0 + 30.0)
            served += min(rate, sustained[minute // 60]) * 60
            demand += rate * 60
        # The spike replaces the curve for spike_s. The hourly policy reacts to it, but what it
        # asks for serves only after start-up: until then (for all of a shorter spike) the
        # spike meets the pool as it is; fixed pools never change.
        base = day.diurnal_rate(day.spike_start_s)
        spike_rate = max(day.spike_rate, base)
        cap = sustained[int(day.spike_start_s // 3600) % 24]
        as_is_s = min(startup, day.spike_s) if name == "hourly" else day.spike_s
        served += (min(spike_rate, cap) * as_is_s + spike_rate * (day.spike_s - as_is_s)
                   - min(base, cap) * day.spike_s)
        demand += (spike_rate - base) * day.spike_s
        p, d = prefill[peak_hour], decode[peak_hour]
        rows.append(PolicyDay(
            name, prefill, decode, gpu_hours, cost_per_1k_queries(gpu_hours, price_per_gpu_hour, queries),
            served / demand,
            min(1.0, sustained_rate(profile, shape, slo, p - 1, d - 1) / day.peak_rate),
            min(1.0, sustained_rate(profile, shape, slo, zone_survivors(p, zones),
                                    zone_survivors(d, zones)) / day.peak_rate),
        ))
    return rows
