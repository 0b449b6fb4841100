"""Where the control loop reads worker stats: the Redis registry (the stats each heartbeat
carries), or each registered worker's Prometheus /metrics (the same counters, scraped).
Both return WorkerInfo lists for WorkerStatsRates. Called from the control loop's thread."""

from __future__ import annotations

import dataclasses
import logging
import time
import urllib.request
from typing import Protocol

import redis
from prometheus_client.parser import text_string_to_metric_families

from services.common.registry import WORKER_KEY, WorkerInfo, decode_entries

log = logging.getLogger(__name__)

# Prometheus name (services/common/metrics.py) -> registry stats key.
PROMETHEUS_STATS = {
    "splitserve_worker_running_requests": "running",
    "splitserve_worker_waiting_requests": "waiting",
    "splitserve_worker_waiting_for_kv_requests": "waiting_for_kv",
    "splitserve_worker_waiting_for_blocks_requests": "reservations_waiting",
    "splitserve_kv_blocks_total": "kv_blocks_total",
    "splitserve_kv_blocks_used": "kv_blocks_used",
    "splitserve_worker_queued_prefill_tokens": "queued_prefill_tokens",
    "splitserve_worker_computed_tokens": "computed_tokens",
    "splitserve_worker_steps": "steps",
}

# services/common/startup.py: seconds per phase, which sum to the worker's start-up.
STARTUP_METRIC = "splitserve_worker_startup_seconds"


class WorkerSource(Protocol):
    def workers(self) -> list[WorkerInfo]:
        """Every live worker with its latest stats; raises if the source cannot be read."""


class RegistrySource:
    """The workers registered in Redis (services.common.registry), read synchronously. With
    the workers' cluster secret only entries signed with it count (as the gateways read them):
    anything that can write to Redis could otherwise ask for the pools' maximum. An entry
    left out is logged once and never hides the others."""

    def __init__(self, redis_url: str, secret: bytes | None = None) -> None:
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=2, socket_connect_timeout=2)
        self.secret = secret
        self.rejected: dict[str, str] = {}  # key -> reason, as of the last read

    def workers(self) -> list[WorkerInfo]:
        keys = list(self.redis.scan_iter(match=WORKER_KEY + "*", count=500))
        found, rejected = decode_entries(keys, self.redis.mget(keys) if keys else [],
                                         self.secret)
        for name, reason in rejected.items():
            if self.rejected.get(name) != reason:
                log.warning("leaving registry entry %s out of the plan (%s)", name, reason)
        self.rejected = rejected
        return found

    def close(self) -> None:
        self.redis.close()


class PrometheusSource:
    """Registry for who exists, each worker's /metrics for its counters (fresher than the
    heartbeat, and the same numbers a Prometheus server stores)."""

    def __init__(self, registry: RegistrySource, timeout_s: float = 2.0) -> None:
        self.registry = registry
        self.timeout_s = timeout_s

    def workers(self) -> list[WorkerInfo]:
        found = []
        for info in self.registry.workers():
            if not info.metrics_address:
                found.append(info)
                continue
            try:
                stats = self.scrape(info.metrics_address)
            except OSError as exc:
                log.warning("cannot scrape %s (%s): using its heartbeat stats", info.worker_id, exc)
                found.append(info)
                continue
            found.append(dataclasses.replace(info, stats=stats, updated=time.time()))
        return found

    def scrape(self, address: str) -> dict[str, float]:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=self.timeout_s) as reply:
            return parse_worker_metrics(reply.read().decode())


def parse_worker_metrics(text: str) -> dict[str, float]:
    """A worker's /metrics text -> the registry's stats keys."""
    stats: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # Counters are exposed as NAME_total; a gauge may itself end in _total.
            name = sample.name if sample.name in PROMETHEUS_STATS else sample.name.removesuffix("_total")
            if name in PROMETHEUS_STATS:
                stats[PROMETHEUS_STATS[name]] = sample.value
        if family.name == STARTUP_METRIC:  # the phases of its start-up: their sum
            stats["startup_s"] = sum(s.value for s in family.samples)
    if "kv_blocks_used" in stats:
        stats["kv_blocks_free"] = stats.get("kv_blocks_total", 0.0) - stats.pop("kv_blocks_used")
    return stats
