"""Scaling policies compared in simulation, and what a run reports.

- fixed: the replicas `capacity plan` gives for the trace's peak rate, all the time.
- reactive: an HPA-like utilisation rule (15 s sync, 10% tolerance, target 80%, scale-up at
  most max(2x, +4) per sync, scale-down to the highest recommendation of the planner's
  stabilisation window), on served load against the per-replica capacities the planner uses.
- planner: the real control loop (Autoscaler + Planner) against the simulated registry.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from services.autoscaler.capacity import SLO, CapacityModel, WorkloadShape, plan_for_rate
from services.autoscaler.control_loop import Autoscaler
from services.autoscaler.demand import WorkerStatsRates
from services.autoscaler.planner import ROLES, Planner, PlannerConfig
from services.autoscaler.profile import HardwareProfile
from services.autoscaler.simulator import ClusterSim, SimActuator, SimSettings, SimSource
from services.autoscaler.traces import Trace


@dataclass(frozen=True)
class SimResult:
    policy: str
    trace: str
    requests: int
    slo_attainment: float  # share of requests finished within both TTFT and ITL targets
    ttft_attainment: float
    itl_attainment: float
    failed: int
    worker_hours: float
    prefill_hours: float
    decode_hours: float
    ttft_p50: float
    ttft_p90: float
    itl_mean: float
    timeline: list = field(default_factory=list, repr=False)  # (t, prefill live, decode live, rate)


class FixedPolicy:
    name = "fixed"
    interval_s = 3600.0

    def __init__(self, replicas: dict[str, int]) -> None:
        self.counts = replicas

    def initial(self) -> dict[str, int]:
        return self.counts

    def tick(self, now: float, sim: ClusterSim) -> None:
        pass


class ReactivePolicy:
    """desired = ceil(ready x utilisation / target), utilisation = served tokens/s over what
    the ready replicas sustain within the SLO (decode: or KV use, if higher)."""

    name = "reactive"

    def __init__(self, profile: HardwareProfile, slo: SLO, shape: WorkloadShape,
                 initial: dict[str, int], limits: dict[str, tuple[int, int]], target: float = 0.8,
                 interval_s: float = 15.0, tolerance: float = 0.1, window_s: float = 60.0) -> None:
        model = CapacityModel()
        self.prefill_cap = model.prefill(profile, slo, shape).tokens_per_s
        self.decode_cap = model.decode(profile, slo, shape)
        self.start, self.limits, self.target = initial, limits, target
        self.interval_s, self.tolerance, self.window_s = interval_s, tolerance, window_s
        self.rates = WorkerStatsRates()
        self.history = {role: deque() for role in ROLES}
        self._computed: dict[str, tuple[float, float]] = {}
        self._first: float | None = None

    def initial(self) -> dict[str, int]:
        return self.start

    def tick(self, now: float, sim: ClusterSim) -> None:
        workers = sim.registry_view()
        sample = self.rates.update(now, workers)
        # Utilisation sees only what the prefill workers computed (like CPU use), not their
        # queues: the difference between this rule and the planner's demand signal.
        computed = {w.worker_id: (w.stats["computed_tokens"], w.updated)
                    for w in workers if w.role == "prefill"}
        served = sum((c - self._computed[k][0]) / (t - self._computed[k][1])
                     for k, (c, t) in computed.items()
                     if k in self._computed and t > self._computed[k][1])
        self._computed = computed
        utilisation = {
            "prefill": served / max(sample.prefill_ready * self.prefill_cap, 1e-9),
            "decode": max(sample.output_tokens_per_s
                          / max(sample.decode_ready * self.decode_cap.tokens_per_s, 1e-9),
                          sample.kv_usage / CapacityModel().kv_utilization),
        }
        actuator = SimActuator(sim)
        if self._first is None:  # counters need two readings before they give a rate
            self._first = now
            return
        for role in ROLES:
            ready = sample.prefill_ready if role == "prefill" else sample.decode_ready
            current = actuator.replicas(role)
            ratio = utilisation[role] / self.target
            proposal = current if abs(ratio - 1) <= self.tolerance or not ready else \
                math.ceil(ready * ratio)
            proposal = min(proposal, max(2 * current, current + 4))
            low, high = self.limits[role]
            proposal = min(max(proposal, low), high)
            history = self.history[role]
            history.append((now, proposal))
            while history[0][0] < now - self.window_s:
                history.popleft()
            settled = now - self._first >= self.window_s  # like HPA: no scale-down at start
            desired = proposal if proposal >= current else \
                min(current, max(n for _, n in history) if settled else current)
            if desired != current:
                actuator.scale(role, desired)


class PlannerPolicy:
    name = "planner"

    def __init__(self, profile: HardwareProfile, config: PlannerConfig,
                 initial: dict[str, int]) -> None:
        self.profile, self.config, self.start = profile, config, initial
        self.interval_s = config.interval_s
        self.autoscaler: Autoscaler | None = None

    def initial(self) -> dict[str, int]:
        return self.start

    def tick(self, now: float, sim: ClusterSim) -> None:
        if self.autoscaler is None:
            self.autoscaler = Autoscaler(SimSource(sim), Planner(self.profile, self.config),
                                         SimActuator(sim))
        self.autoscaler.tick(now)


def simulate(profile: HardwareProfile, trace: Trace, policy, slo: SLO,
             settings: SimSettings | None = None, sample_every_s: float = 5.0) -> SimResult:
    sim = ClusterSim(profile, trace, settings)
    for role, count in policy.initial().items():
        for _ in range(count):
            sim.add_replica(role, ready=True)
    sim.every(policy.interval_s, lambda now: policy.tick(now, sim), trace.duration_s)
    timeline = []
    arrivals = [r.arrival for r in trace.requests]

    def sample(now: float) -> None:
        recent = sum(1 for a in arrivals if now - sample_every_s <= a < now) / sample_every_s
        timeline.append((now, len(sim.live("prefill")), len(sim.live("decode")), recent))

    sim.every(sample_every_s, sample, trace.duration_s)
    sim.run()
    return summarize(policy.name, sim, slo, timeline)


def summarize(policy: str, sim: ClusterSim, slo: SLO, timeline: list) -> SimResult:
    requests, end = sim.requests, sim.trace.duration_s
    ttfts = [r.ttft for r in requests if r.ttft is not None]
    itls = [r.itl for r in requests if r.itl is not None]
    ttft_ok = [not r.failed and r.ttft is not None and r.ttft <= slo.ttft_s for r in requests]
    itl_ok = [not r.failed and r.itl is not None and r.itl <= slo.itl_s for r in requests]
    both = sum(a and b for a, b in zip(ttft_ok, itl_ok, strict=True))
    hours = {role: sum(max(0.0, min(r.stopped if r.stopped is not None else end, end) - r.started)
                       for r in sim.replicas if r.role == role) / 3600 for role in ROLES}
    n = max(len(requests), 1)
    quantiles = statistics.quantiles(ttfts, n=10) if len(ttfts) >= 2 else [0.0] * 9
    return SimResult(
        policy=policy, trace=sim.trace.name, requests=len(requests), slo_attainment=both / n,
        ttft_attainment=sum(ttft_ok) / n, itl_attainment=sum(itl_ok) / n,
        failed=sum(r.failed for r in requests), worker_hours=hours["prefill"] + hours["decode"],
        prefill_hours=hours["prefill"], decode_hours=hours["decode"],
        ttft_p50=statistics.median(ttfts) if ttfts else 0.0, ttft_p90=quantiles[8],
        itl_mean=statistics.fmean(itls) if itls else 0.0, timeline=timeline,
    )


def standard_policies(profile: HardwareProfile, trace: Trace, slo: SLO, shape: WorkloadShape,
                      config: PlannerConfig) -> list:
    """The three policies, each starting from the replicas the trace's opening rate needs
    (fixed: its peak rate) so that none pays for a cold start the others skip."""
    start = plan_for_rate(profile, trace.base_rate, shape, slo, spare=0)
    peak = plan_for_rate(profile, trace.peak_rate, shape, slo, spare=0)
    initial = {"prefill": start.prefill_replicas, "decode": start.decode_replicas}
    limits = {role: config.limits(role) for role in ROLES}
    return [
        FixedPolicy({"prefill": peak.prefill_replicas, "decode": peak.decode_replicas}),
        ReactivePolicy(profile, slo, shape, initial, limits, window_s=config.scale_down_window_s),
        PlannerPolicy(profile, config, initial),
    ]
