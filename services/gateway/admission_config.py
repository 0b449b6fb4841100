"""The admission part of the gateway's configuration (tenants, quotas, fairness, capacity, TTFT
target): checked at start-up with clear errors, then turned into the Admission object."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from services.gateway.admission import Admission
from services.gateway.capacity import CapacityRule, ClusterRoom
from services.gateway.fair_queue import POLICIES, FairQueue
from services.gateway.quota import FAIL_MODES, Quotas
from services.gateway.tenants import load_tenants
from services.gateway.ttft_estimator import TTFTEstimator
from services.gateway.worker_pool import WorkerPool

if TYPE_CHECKING:
    from services.gateway.config import GatewayConfig

log = logging.getLogger(__name__)


def validate_admission(config: GatewayConfig) -> None:
    if config.tenants_file and not os.path.isfile(config.tenants_file):
        raise ValueError(f"--tenants-file {config.tenants_file!r} does not exist")
    if config.fairness not in POLICIES:
        raise ValueError(f"--fairness must be one of {', '.join(POLICIES)}")
    if config.quota_fail_mode not in FAIL_MODES:
        raise ValueError(f"--quota-fail-mode must be one of {', '.join(FAIL_MODES)}")
    if config.ttft_target_s < 0:
        raise ValueError("--ttft-target-s must be >= 0 (0 turns early rejection off)")
    if config.output_token_weight <= 0:
        raise ValueError("--output-token-weight must be > 0")
    for name in ("max_inflight", "max_inflight_per_key", "max_inflight_per_decode",
                 "max_prefill_queue_tokens"):
        if getattr(config, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: no limit)")
    if not 0.0 <= config.kv_headroom < 1.0:
        raise ValueError("--kv-headroom must be in [0, 1)")
    # The tenants file's own errors (unknown settings, bad digests) surface here, at start-up.
    _directory(config)


def _directory(config: GatewayConfig):
    # --max-inflight-per-key predates tenants: it is every tenant's default concurrency.
    defaults = {"max_concurrency": config.max_inflight_per_key} \
        if config.max_inflight_per_key else {}
    return load_tenants(config.tenants_file, config.api_keys, defaults)


def make_admission(config: GatewayConfig, pool: WorkerPool) -> Admission:
    directory = _directory(config)
    log.info("admission: %s; fairness %s; ttft target %gs; quotas %s (fail %s)",
             directory.describe(), config.fairness, config.ttft_target_s,
             "shared in redis" if config.redis_url else "in process", config.quota_fail_mode)
    rule = CapacityRule(config.max_inflight, config.max_inflight_per_decode, config.kv_headroom,
                        config.max_prefill_queue_tokens)
    return Admission(directory, Quotas(config.redis_url, config.quota_fail_mode),
                     FairQueue(config.fairness, config.output_token_weight),
                     ClusterRoom(rule, pool), TTFTEstimator(), config.ttft_target_s)
