"""The planner: DemandSamples in, desired prefill and decode replicas out.

Scale-up sizes each pool for the demand forecast one start-up time ahead (a replica asked for
now serves only after it has loaded). Scale-down waits until the pool has been oversized for a
whole stabilisation window, with a hysteresis margin, and then removes at most
max_scale_down_fraction of it per decision (the actuators remove replicas by draining them).
Capacity is never given away faster than it comes back: the window is at least two start-ups
and scale-downs are at least one start-up apart. Plain arithmetic: no I/O, no clock of its
own, so the simulator drives exactly this code.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from services.autoscaler.capacity import SLO, CapacityModel, WorkloadShape, replicas_for
from services.autoscaler.demand import DemandSample
from services.autoscaler.forecast import TrendForecaster
from services.autoscaler.profile import HardwareProfile

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class PlannerConfig:
    slo: SLO = field(default_factory=SLO)
    # The length mix assumed where the metrics do not say (mean prompt length, output length).
    shape: WorkloadShape = field(default_factory=lambda: WorkloadShape.single(256, 128))
    capacity: CapacityModel = field(default_factory=CapacityModel)
    min_prefill: int = 1
    max_prefill: int = 16
    min_decode: int = 1
    max_decode: int = 16
    interval_s: float = 2.0
    # Seconds from asking for a replica to its serving; None: what the workers measured of
    # their own start-up (splitserve_worker_startup_seconds), else the profile's.
    startup_s: float | None = None
    # A prefill backlog is planned to be worked off within this time after new replicas start.
    backlog_drain_s: float = 10.0
    scale_up_cooldown_s: float = 0.0
    # Both at least as long as the start-up asks (Planner.down_window_s, down_cooldown_s).
    scale_down_cooldown_s: float = 15.0
    scale_down_window_s: float = 60.0
    hysteresis: float = 0.15  # scale down only if the smaller pool keeps this margin spare
    # At most this share of a pool is drained per decision (at least one replica).
    max_scale_down_fraction: float = 0.5

    def __post_init__(self) -> None:
        for role in ROLES:
            low, high = self.limits(role)
            if not 0 <= low <= high:
                raise ValueError(f"{role} replicas: need 0 <= min ({low}) <= max ({high})")
        if not 0 <= self.hysteresis < 1:
            raise ValueError("hysteresis must be in [0, 1)")
        if not 0 < self.max_scale_down_fraction <= 1:
            raise ValueError("max_scale_down_fraction must be in (0, 1]")

    def limits(self, role: str) -> tuple[int, int]:
        return ((self.min_prefill, self.max_prefill) if role == "prefill"
                else (self.min_decode, self.max_decode))


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int  # replicas asked for before this decision (starting ones included)
    desired: int  # replicas to ask for now
    needed: float  # replicas the forecast demand needs (fractional)
    demand: float  # forecast demand: prompt tokens/s (prefill) or output tokens/s (decode)
    per_replica: float  # what one replica sustains within the SLO, same unit as demand
    reason: str


@dataclass(frozen=True)
class ScaleDecision:
    time: float
    prefill: RoleDecision
    decode: RoleDecision

    def role(self, role: str) -> RoleDecision:
        return self.prefill if role == "prefill" else self.decode


class Planner:
    """Owned by one thread (the control loop's, or the simulator's)."""

    def __init__(self, profile: HardwareProfile, config: PlannerConfig | None = None) -> None:
        self.profile = profile
        self.config = config or PlannerConfig()
        self.prompt_rate = TrendForecaster()
        self.output_rate = TrendForecaster()
        self.latest: DemandSample | None = None
        # Samples of the last down_window_s: scale-down follows their mean, which is
        # steadier than any short-term estimate (a handful of requests per interval is noise).
        self._window: deque[DemandSample] = deque()
        self._last_up = {r: -math.inf for r in ROLES}
        self._last_change = {r: -math.inf for r in ROLES}
        self.measured_startup_s: float | None = None  # the slowest live worker's own start-up

    @property
    def startup_s(self) -> float:
        """The horizon's start-up: --startup-s if given, else the workers' measured start-up
        once any reported one, else the profile's."""
        if self.config.startup_s is not None:
            return self.config.startup_s
        if self.measured_startup_s is not None:
            return self.measured_startup_s
        return self.profile.startup_s

    @property
    def down_window_s(self) -> float:
        """The mean scale-down follows spans at least two start-ups: a pool drained on a
        shorter lull than it takes to bring a replica back is short when the load returns (with
        GPU workers' minutes of start-up, 60 s took 16 replicas down to 1 in under a minute)."""
        return max(self.config.scale_down_window_s, 2 * self.startup_s)

    @property
    def down_cooldown_s(self) -> float:
        """Scale-downs are at least one start-up apart (and after any change)."""
        return max(self.config.scale_down_cooldown_s, self.startup_s)

    def observe_startup(self, seconds: list[float]) -> None:
        """The start-ups the live workers report; the slowest sets the horizon (a replica asked
        for now may be as slow as any). Nothing reported keeps the last figure."""
        if seconds:
            self.measured_startup_s = max(seconds)

    def observe(self, sample: DemandSample) -> None:
        self.prompt_rate.observe(sample.time, sample.prompt_tokens_per_s)
        self.output_rate.observe(sample.time, sample.output_tokens_per_s)
        self.latest = sample
        self._window.append(sample)
        while self._window[0].time < sample.time - self.down_window_s:
            self._window.popleft()

    def _window_mean(self, value) -> float:
        return statistics.fmean(value(s) for s in self._window) if self._window else 0.0

    def plan(self, now: float, current: dict[str, int]) -> ScaleDecision:
        sample = self.latest or DemandSample(now, 0.0, 0.0)
        horizon = self.startup_s + self.config.interval_s
        prefill = self._prefill_need(sample, horizon)
        decode = self._decode_need(sample, horizon)
        return ScaleDecision(now, self._decide("prefill", now, current["prefill"], *prefill),
                             self._decide("decode", now, current["decode"], *decode))

    # -- how many replicas the demand needs -------------------------------------------------

    def _shape(self, sample: DemandSample) -> WorkloadShape:
        if sample.mean_prompt_tokens:
            return WorkloadShape.single(sample.mean_prompt_tokens, self.config.shape.mean_output_tokens)
        return self.config.shape

    def _prefill_need(self, sample: DemandSample, horizon: float):
        """(replicas needed for scale-up, for scale-down, forecast demand, per replica)."""
        cap = self.config.capacity.prefill(self.profile, self.config.slo, self._shape(sample))
        # A queue the ready replicas clear within the TTFT target is normal; beyond that it is
        # demand the rate has not shown yet (a burst), to be worked off within backlog_drain_s.
        absorbed = (sample.prefill_ready * cap.peak_tokens_per_s
                    * max(self.config.slo.ttft_s - cap.service_s, 0.0))
        # Replicas asked for now work only after start-up: plan the backlog over both.
        drain_s = self.config.backlog_drain_s + self.startup_s
        backlog = max(0.0, sample.queued_prefill_tokens - absorbed) / drain_s
        up = self.prompt_rate.forecast(horizon) + backlog
        down = self._window_mean(lambda s: s.prompt_tokens_per_s)
        per = max(cap.tokens_per_s, 1e-9)
        return up / per, down / (per * (1 - self.config.hysteresis)), up, per

    def _decode_need(self, sample: DemandSample, horizon: float):
        shape = self._shape(sample)
        cap = self.config.capacity.decode(self.profile, self.config.slo, shape,
                                          sample.mean_context_tokens)
        # Output demand follows prompt arrivals by one prefill: requests arriving now decode
        # soon, so the prompt forecast (as requests x mean output) leads the output rate.
        per_prompt = shape.mean_output_tokens / shape.mean_prompt_tokens
        up_rate = max(self.output_rate.forecast(horizon),
                      self.prompt_rate.forecast(horizon) * per_prompt)
        mean_rate = max(self._window_mean(lambda s: s.output_tokens_per_s),
                        self._window_mean(lambda s: s.prompt_tokens_per_s) * per_prompt)
        # KV in use grows with the output rate (Little's law) until the forecast arrives.
        now_rate = self.output_rate.smoothed()
        growth = min(up_rate / now_rate, 2.0) if now_rate > 0 else 1.0
        kv_up = sample.kv_blocks_used * max(growth, 1.0) / max(cap.kv_blocks, 1e-9)
        kv_down = self._window_mean(lambda s: s.kv_blocks_used) / max(cap.kv_blocks, 1e-9)
        # Admitted sequences (running or about to be) each need a batch slot: the fastest
        # signal of a burst. Not used to scale down: the count shrinks only as the pool grows
        # (Little's law), so it would hold an oversized pool.
        slots = (sample.decode_sequences - sample.decode_waiting_for_kv) / cap.batch_size
        per = max(cap.tokens_per_s, 1e-9)
        margin = 1 - self.config.hysteresis
        up = max(up_rate / per, kv_up, slots)
        down = max(mean_rate / per, kv_down) / margin
        return up, down, up_rate, per

    # -- hysteresis, cooldowns, limits ----------------------------------------------------

    def _decide(self, role: str, now: float, current: int, up_need: float, down_need: float,
                demand: float, per: float) -> RoleDecision:
        cfg = self.config
        low, high = cfg.limits(role)
        up = min(max(replicas_for(up_need, 1.0), low), high)
        down = min(max(replicas_for(max(up_need, down_need), 1.0), low), high)
        desired, reason = current, "steady"
        if current > high or (current < low and up <= low):
            desired, reason = min(max(current, low), high), "limits"
        elif up > current:
            if now - self._last_up[role] >= cfg.scale_up_cooldown_s:
                desired, reason = up, "demand forecast"
            else:
                reason = "scale-up cooldown"
        elif down < current:
            # Never drain while replicas asked for are still starting: until they serve, the
            # metrics cannot show that they were needed.
            cooldown = self.down_cooldown_s
            settled = (now - self._last_change[role] >= cooldown
                       and now - self._last_up[role] >= self.startup_s + cooldown)
            window_full = bool(self._window) and (
                self._window[0].time <= now - self.down_window_s + cfg.interval_s)
            if settled and window_full:
                step = max(1, math.floor(current * cfg.max_scale_down_fraction))
                desired = max(down, current - step)
                reason = "demand fell (draining)"
            else:
                reason = "scale-down stabilising"
        if desired > current:
            self._last_up[role] = now
        if desired != current:
            self._last_change[role] = now
        return RoleDecision(role, current, desired, up_need, demand, per, reason)
