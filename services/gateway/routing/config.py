"""The routing part of the gateway's configuration: checked at start-up with clear errors,
then turned into a router over the worker pool."""

from __future__ import annotations

from typing import Protocol

from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.router import ScoringRouter
from services.gateway.routing.scorers import build_scorers, parse_weights
from services.gateway.routing.worker_pool import WorkerPool

ROUTING_POLICIES = ("scored", "round_robin")


class RoutingSettings(Protocol):
    """The settings routing reads. GatewayConfig is one; it is not imported here because it
    validates itself with validate_routing (config.py -> this module, never back)."""

    @property
    def routing(self) -> str: ...
    @property
    def decode_scorers(self) -> str: ...
    @property
    def prefill_scorers(self) -> str: ...
    @property
    def local_prefill_tokens(self) -> int: ...
    @property
    def prefill_backlog_tokens(self) -> int: ...
    @property
    def decode_affinity_slack(self) -> int: ...
    @property
    def breaker_failures(self) -> int: ...
    @property
    def breaker_open_s(self) -> float: ...
    @property
    def registry_interval_s(self) -> float: ...
    @property
    def redis_url(self) -> str: ...


def validate_routing(config: RoutingSettings) -> None:
    if config.routing not in ROUTING_POLICIES:
        raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
    for flag, text in (("--decode-scorers", config.decode_scorers),
                       ("--prefill-scorers", config.prefill_scorers)):
        try:
            parse_weights(text)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from None
    for name in ("local_prefill_tokens", "prefill_backlog_tokens"):
        if getattr(config, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0 turns it off)")
    if config.breaker_failures < 1:
        raise ValueError("--breaker-failures must be >= 1")
    for name in ("breaker_open_s", "registry_interval_s"):
        if getattr(config, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    if config.redis_url and not config.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("--redis-url must look like redis://host:port/db")


def make_router(config: RoutingSettings, pool: WorkerPool, index: PrefixIndex) -> ScoringRouter:
    """`round_robin` is the baseline cache-aware routing is measured against: no scorers
    (every worker ties) and no local prefill of short prompts."""
    if config.routing == "round_robin":
        return ScoringRouter(pool, index, decode_scorers=[], prefill_scorers=[],
                             local_prefill_tokens=0,
                             prefill_backlog_tokens=config.prefill_backlog_tokens)
    return ScoringRouter(
        pool, index,
        decode_scorers=build_scorers(config.decode_scorers, index),
        prefill_scorers=build_scorers(config.prefill_scorers, index),
        local_prefill_tokens=config.local_prefill_tokens,
        prefill_backlog_tokens=config.prefill_backlog_tokens,
        decode_affinity_slack=config.decode_affinity_slack,
    )
