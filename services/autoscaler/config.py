"""The autoscaler's one typed configuration object, from CLI flags and SPLITSERVE_AUTOSCALER_*
environment variables (REDIS_URL and SPLITSERVE_LOG_LEVEL are shared with the other processes)."""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from services.autoscaler.capacity import SLO, WorkloadShape
from services.autoscaler.planner import PlannerConfig

ACTUATORS = ("k8s", "local", "dry-run")
SOURCES = ("registry", "prometheus")
# Measured with `splitserve profile` (SmolLM2-135M, CPU, 1 thread); used when --profile is unset.
DEFAULT_PROFILE = Path(__file__).with_name("default_profile.json")


@dataclass(frozen=True)
class AutoscalerConfig:
    redis_url: str = ""
    # The workers' cluster secret: only registry entries signed with it are counted.
    cluster_secret_file: str = ""
    actuator: str = "dry-run"
    source: str = "registry"
    profile: str = ""  # JSON from `splitserve profile`; empty: the bundled default profile
    # k8s actuator
    namespace: str = "default"
    prefill_deployment: str = ""
    decode_deployment: str = ""
    # local actuator
    model: str = "models/smollm2-135m-instruct"
    prefill_args: str = ""  # extra flags for local prefill workers, e.g. "--kv-cache-memory 2GiB"
    decode_args: str = ""
    # warm pool: workers per role kept started with --standby, activated on scale-up
    warm_pool_prefill: int = 0
    warm_pool_decode: int = 0
    # planner
    interval_s: float = 2.0
    ttft_s: float = 2.0
    itl_s: float = 0.2
    length_mix: str = "256:128"  # prompt:output[:weight],... (capacity arithmetic defaults)
    min_prefill_replicas: int = 1
    max_prefill_replicas: int = 16
    min_decode_replicas: int = 1
    max_decode_replicas: int = 16
    startup_s: float = -1.0  # <0: the workers' measured start-up, else the profile's
    scale_down_window_s: float = 60.0
    scale_down_cooldown_s: float = 15.0  # as PlannerConfig, what bench/autoscaler_sim.py runs
    hysteresis: float = 0.15
    backlog_drain_s: float = 10.0
    # status server (/health, /ready, /metrics)
    host: str = "0.0.0.0"
    port: int = 9100
    log_level: str = "INFO"
    log_format: str = "json"

    def __post_init__(self) -> None:
        if self.actuator not in ACTUATORS:
            raise ValueError(f"--actuator {self.actuator!r}: choose {', '.join(ACTUATORS)}")
        if self.source not in SOURCES:
            raise ValueError(f"--source {self.source!r}: choose {', '.join(SOURCES)}")
        if not self.redis_url:
            raise ValueError("--redis-url (or REDIS_URL) is required: workers register there")
        if self.actuator == "k8s" and not (self.prefill_deployment and self.decode_deployment):
            raise ValueError("--actuator k8s needs --prefill-deployment and --decode-deployment")
        if self.actuator == "local" and not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ValueError(f"--model {self.model!r} is not a model folder (the local actuator "
                             "starts workers with it)")
        if self.profile and not os.path.isfile(self.profile):
            raise ValueError(f"--profile {self.profile!r} does not exist; run `splitserve profile`")
        if self.interval_s <= 0:
            raise ValueError("--interval-s must be > 0")
        if self.warm_pool_prefill < 0 or self.warm_pool_decode < 0:
            raise ValueError("--warm-pool-prefill and --warm-pool-decode must be >= 0")
        if (self.warm_pool_prefill or self.warm_pool_decode) and self.actuator != "local":
            raise ValueError("a warm pool is kept by the local actuator only (--actuator local); "
                             "on Kubernetes, start spare pods with --standby and activate them "
                             "with `splitserve activate`")
        self.planner_config()  # validates SLOs, length mix and limits

    @property
    def profile_path(self) -> Path:
        return Path(self.profile) if self.profile else DEFAULT_PROFILE

    def planner_config(self) -> PlannerConfig:
        return PlannerConfig(
            slo=SLO(self.ttft_s, self.itl_s), shape=WorkloadShape.parse(self.length_mix),
            min_prefill=self.min_prefill_replicas, max_prefill=self.max_prefill_replicas,
            min_decode=self.min_decode_replicas, max_decode=self.max_decode_replicas,
            interval_s=self.interval_s, startup_s=self.startup_s if self.startup_s >= 0 else None,
            scale_down_window_s=self.scale_down_window_s,
            scale_down_cooldown_s=self.scale_down_cooldown_s, hysteresis=self.hysteresis,
            backlog_drain_s=self.backlog_drain_s,
        )

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


_ENV = {"redis_url": "REDIS_URL", "log_level": "SPLITSERVE_LOG_LEVEL",
        "cluster_secret_file": "SPLITSERVE_CLUSTER_SECRET_FILE"}


def env_name(field_name: str) -> str:
    return _ENV.get(field_name, f"SPLITSERVE_AUTOSCALER_{field_name.upper()}")


_HELP = {
    "redis_url": "the worker registry",
    "cluster_secret_file": "the workers' --cluster-secret-file: registry entries not signed "
                           "with it are left out of the plan (empty: every entry is trusted)",
    "actuator": "k8s (patch Deployment scale), local (start/drain worker processes) or dry-run",
    "source": "registry (heartbeat stats) or prometheus (scrape each worker's /metrics)",
    "profile": "JSON from `splitserve profile` (empty: the bundled SmolLM2-on-CPU profile)",
    "prefill_deployment": "k8s: the prefill Deployment's name",
    "decode_deployment": "k8s: the decode Deployment's name",
    "model": "local: the model folder workers load",
    "prefill_args": "local: extra flags for prefill workers",
    "decode_args": "local: extra flags for decode workers",
    "warm_pool_prefill": "local: prefill workers kept loaded but unregistered (--standby), "
                         "activated in under a second on scale-up",
    "warm_pool_decode": "local: the same for decode workers",
    "ttft_s": "time-to-first-token target (seconds)",
    "itl_s": "inter-token latency target (seconds, a request's mean)",
    "length_mix": "prompt:output[:weight],... assumed where the metrics do not say",
    "startup_s": "seconds from asking for a worker to its serving (<0: what the workers "
                 "measured of their own start-up, else the profile's)",
    "scale_down_window_s": "scale down to the mean demand of this window",
    "scale_down_cooldown_s": "no scale-down sooner than this after any change",
    "hysteresis": "scale down only if the smaller pool keeps this share spare",
    "backlog_drain_s": "plan to clear a prefill backlog within this time",
    "port": "HTTP port of /health, /ready, /metrics",
}


def add_autoscaler_arguments(parser: argparse.ArgumentParser) -> None:
    """A flag per AutoscalerConfig field; each defaults to its environment variable if set."""
    for f in fields(AutoscalerConfig):
        flag = "--" + f.name.replace("_", "-")
        parser.add_argument(flag, default=os.environ.get(env_name(f.name)),
                            metavar=f.name.upper(),
                            help=f"{_HELP.get(f.name, '')} (env {env_name(f.name)}; "
                                 f"default {f.default!r})".strip())


def autoscaler_config_from_args(args: argparse.Namespace) -> AutoscalerConfig:
    """Raises SystemExit with a one-line message for invalid settings."""
    values = {}
    try:
        for f in fields(AutoscalerConfig):
            raw = getattr(args, f.name)
            if raw is None:
                continue
            values[f.name] = {"int": int, "float": float}.get(f.type, str)(raw)
        return AutoscalerConfig(**values)
    except ValueError as exc:
        raise SystemExit(f"splitserve autoscaler: {exc}") from None
