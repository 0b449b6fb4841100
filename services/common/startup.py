"""A worker's start-up by phase, from the process's own start to its ready line: printed there,
exported as `splitserve_worker_startup_seconds{model,role,phase}` and read by the autoscaler.

Owned by the main thread while the worker starts; frozen once ready (read by /metrics threads)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily

# In timeline order; they tile process start -> ready, so they sum to the whole start-up.
PHASES = ("imports", "weight_load", "kernel_load", "kernel_choice", "memory_profile",
          "kv_allocation", "serving")
PHASE_MEANING = {
    "imports": "interpreter start, module imports, logging and tracing set-up",
    "weight_load": "model built in the serving dtype and filled from the checkpoint",
    "kernel_load": "C++ CPU kernels built (first time) or loaded",
    "kernel_choice": "kernels chosen by timing them on this machine (engine/kernel_choice.py) "
                     "and the weights packed for them",
    "memory_profile": "the largest step run once to size the KV pool (engine/memory_profile.py; "
                      "0 with --num-kv-blocks)",
    "kv_allocation": "KV cache allocated, the rest of engine set-up",
    "serving": "engine thread, KV endpoints, gRPC and status servers, registry publisher",
}


def process_age_s() -> float:
    """Seconds since this process was started by the kernel (Linux: /proc, 10 ms ticks), so
    interpreter start-up and imports count. Elsewhere 0: the clock starts at the first call."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        # Field 22 (starttime, clock ticks since boot); the command name before it may hold
        # spaces, so count from the closing parenthesis.
        start_ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        started = start_ticks / os.sysconf("SC_CLK_TCK")
        return max(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


@dataclass
class StartupClock:
    """Marks phase ends on the monotonic clock, anchored at the process's start."""

    origin: float  # monotonic time of the process start
    last: float
    phases: dict[str, float]

    @classmethod
    def since_process_start(cls) -> StartupClock:
        now = time.monotonic()
        origin = now - process_age_s()
        return cls(origin=origin, last=origin, phases={})

    def end_phase(self, name: str, *, of_which: dict[str, float] | None = None) -> None:
        """The time since the previous mark is phase `name`; parts of it measured inside
        (`of_which`: phase -> seconds) are split out of it and booked under their own names."""
        now = time.monotonic()
        elapsed = now - self.last
        for part, seconds in (of_which or {}).items():
            seconds = min(max(seconds, 0.0), elapsed)
            self.phases[part] = self.phases.get(part, 0.0) + seconds
            elapsed -= seconds
        self.phases[name] = self.phases.get(name, 0.0) + elapsed
        self.last = now

    @property
    def total_s(self) -> float:
        return self.last - self.origin

    def snapshot(self) -> dict[str, float]:
        """Every phase in timeline order (0 for one that did not run)."""
        return {name: self.phases.get(name, 0.0) for name in PHASES}

    def describe(self) -> str:
        """The ready line's fields: `startup_s=12.345 startup=imports:2.103,weight_load:...`."""
        parts = ",".join(f"{name}:{seconds:.3f}" for name, seconds in self.snapshot().items())
        return f"startup_s={self.total_s:.3f} startup={parts}"


def parse_ready_fields(fields: dict[str, str]) -> dict[str, float]:
    """The phases back from a ready line's `startup=` field (launchers, benchmarks)."""
    phases = {}
    for item in filter(None, fields.get("startup", "").split(",")):
        name, _, seconds = item.partition(":")
        phases[name] = float(seconds)
    return phases


class StartupCollector:
    """`splitserve_worker_startup_seconds{model,role,phase}` on the worker's /metrics (`model`
    the served model's name, as on every worker series); registered once the worker is ready,
    so a scrape never sees a start-up still in progress."""

    def __init__(self, clock: StartupClock, role: str, model: str) -> None:
        self.clock = clock
        self.role = role
        self.model = model

    def describe(self):
        return []

    def collect(self):
        family = GaugeMetricFamily(
            "splitserve_worker_startup_seconds",
            "Seconds of this worker's start-up by phase, from process start to ready.",
            labels=["model", "role", "phase"])
        for phase, seconds in self.clock.snapshot().items():
            family.add_metric([self.model, self.role, phase], seconds)
        yield family
