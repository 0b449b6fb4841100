"""The control loop: read workers -> DemandSample -> planner -> actuator, every interval.

`tick(now)` is one iteration and is all the simulator calls, with a simulated source, clock and
actuator; `run()` adds the wall clock, error handling and metrics for the real process. One
thread owns an Autoscaler; the status server only reads `healthy`/`ready` and the metrics.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from prometheus_client import Counter, Gauge

from services.autoscaler.actuators import Actuator
from services.autoscaler.demand import DemandSample, WorkerStatsRates
from services.autoscaler.planner import ROLES, Planner, ScaleDecision
from services.autoscaler.sources import WorkerSource
from services.common.metrics import process_registry

log = logging.getLogger(__name__)


class AutoscalerMetrics:
    """What /metrics shows: desired and ready replicas, forecast demand, capacity, events."""

    def __init__(self) -> None:
        self.registry = r = process_registry()
        self.desired = Gauge("splitserve_autoscaler_desired_replicas",
                             "Replicas the planner asks for.", ["role"], registry=r)
        self.ready = Gauge("splitserve_autoscaler_ready_replicas",
                           "Registered, non-draining workers.", ["role"], registry=r)
        self.demand = Gauge("splitserve_autoscaler_demand_tokens_per_second",
                            "Forecast demand (prompt tokens for prefill, output for decode).",
                            ["role"], registry=r)
        self.per_replica = Gauge("splitserve_autoscaler_replica_capacity_tokens_per_second",
                                 "What one replica sustains within the SLO.", ["role"], registry=r)
        self.scale_events = Counter("splitserve_autoscaler_scale_events",
                                    "Replica count changes.", ["role", "direction"], registry=r)
        self.errors = Counter("splitserve_autoscaler_errors",
                              "Iterations that failed (source or actuator).", registry=r)
        self.startup = Gauge("splitserve_autoscaler_startup_horizon_seconds",
                             "Worker start-up the planner plans ahead for.", registry=r)

    def record(self, sample: DemandSample, decision: ScaleDecision, startup_s: float) -> None:
        self.startup.set(startup_s)
        for role in ROLES:
            d = decision.role(role)
            self.desired.labels(role).set(d.desired)
            self.demand.labels(role).set(d.demand)
            self.per_replica.labels(role).set(d.per_replica)
            if d.desired != d.current:
                self.scale_events.labels(role, "up" if d.desired > d.current else "down").inc()
        self.ready.labels("prefill").set(sample.prefill_ready)
        self.ready.labels("decode").set(sample.decode_ready)


# A start-up a worker reports above this is a bad entry, not a measurement.
MAX_STARTUP_S = 3600.0


def reported_startups(workers) -> list[float]:
    """Each worker's own start-up (stats["startup_s"], from its heartbeat or /metrics); a value
    that is missing, not a number or out of range is skipped (registry entries come off the
    network)."""
    found = []
    for worker in workers:
        value = worker.stats.get("startup_s") if isinstance(worker.stats, dict) else None
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value) and 0 < value <= MAX_STARTUP_S:
            found.append(float(value))
    return found


class Autoscaler:
    def __init__(self, source: WorkerSource, planner: Planner, actuator: Actuator,
                 metrics: AutoscalerMetrics | None = None) -> None:
        self.source = source
        self.planner = planner
        self.actuator = actuator
        self.metrics = metrics
        self.rates = WorkerStatsRates()
        self.last_ok = 0.0  # wall time of the last iteration that worked
        self.history: list[tuple[DemandSample, ScaleDecision]] = []
        self.keep_history = 0  # >0: keep that many iterations (tests, simulator plots)

    def tick(self, now: float) -> ScaleDecision:
        workers = self.source.workers()
        sample = self.rates.update(now, workers)
        self.planner.observe(sample)
        self.planner.observe_startup(reported_startups(workers))
        current = {role: self.actuator.replicas(role) for role in ROLES}
        decision = self.planner.plan(now, current)
        for role in ROLES:
            d = decision.role(role)
            if d.desired != d.current:
                log.info("%s: %d -> %d replicas (%s; demand %.0f tokens/s, %.0f per replica)",
                         role, d.current, d.desired, d.reason, d.demand, d.per_replica)
                self.actuator.scale(role, d.desired, [w for w in workers if w.role == role])
        if self.metrics is not None:
            self.metrics.record(sample, decision, self.planner.startup_s)
        if self.keep_history:
            self.history.append((sample, decision))
            del self.history[:-self.keep_history]
        return decision

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Tick on the wall clock until `stop` is set; a failed tick is logged and retried."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.tick(time.time())
                self.last_ok = time.time()
            except Exception as exc:
                log.warning("autoscaler iteration failed: %s", exc, exc_info=log.isEnabledFor(logging.DEBUG))
                if self.metrics is not None:
                    self.metrics.errors.inc()
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))

    def ready(self, interval_s: float) -> bool:
        """The last iteration worked, recently (source and actuator reachable)."""
        return time.time() - self.last_ok < max(3 * interval_s, 10.0)
