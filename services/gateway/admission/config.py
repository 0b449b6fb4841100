"""The admission part of the gateway's configuration (tenants, quotas, fairness, capacity, TTFT
target): checked at start-up with clear errors, then turned into the Admission object."""

from __future__ import annotations

import logging
import os
from typing import Protocol

from services.common.security import read_cluster_secret
from services.gateway.admission.admission import Admission, CachedTokens, OnAdmitted
from services.gateway.admission.capacity import CapacityRule, ClusterRoom
from services.gateway.admission.fair_queue import POLICIES, FairQueue
from services.gateway.admission.quota import FAIL_MODES, Quotas
from services.gateway.admission.tenants import load_tenants
from services.gateway.admission.ttft_estimator import TTFTEstimator
from services.gateway.routing.worker_pool import WorkerPool

log = logging.getLogger(__name__)


class AdmissionSettings(Protocol):
    """The settings admission reads. GatewayConfig is one; it is not imported here because it
    validates itself with validate_admission (config.py -> this module, never back)."""

    @property
    def tenants_file(self) -> str: ...
    @property
    def api_keys(self) -> tuple[str, ...]: ...
    @property
    def api_keys_file(self) -> str: ...
    @property
    def tenants_reload_s(self) -> float: ...
    @property
    def redis_url(self) -> str: ...
    @property
    def quota_fail_mode(self) -> str: ...
    @property
    def fairness(self) -> str: ...
    @property
    def output_token_weight(self) -> float: ...
    @property
    def anonymous_fairness(self) -> str: ...
    @property
    def ttft_target_s(self) -> float: ...
    @property
    def tpot_target_s(self) -> float: ...
    @property
    def max_inflight(self) -> int: ...
    @property
    def max_inflight_per_key(self) -> int: ...
    @property
    def max_inflight_per_decode(self) -> int: ...
    @property
    def kv_headroom(self) -> float: ...
    @property
    def max_prefill_queue_tokens(self) -> int: ...


def validate_admission(config: AdmissionSettings) -> None:
    if config.tenants_file and not os.path.isfile(config.tenants_file):
        raise ValueError(f"--tenants-file {config.tenants_file!r} does not exist")
    if config.api_keys_file and not os.path.isfile(config.api_keys_file):
        raise ValueError(f"--api-keys-file {config.api_keys_file!r} does not exist")
    if config.api_keys_file and not read_api_keys_file(config.api_keys_file):
        # An empty key file would mean no authentication at all: surely not what was meant.
        raise ValueError(f"--api-keys-file {config.api_keys_file!r} holds no key")
    if config.tenants_reload_s < 0:
        raise ValueError("--tenants-reload-s must be >= 0 (0: reload only on SIGHUP)")
    if config.fairness not in POLICIES:
        raise ValueError(f"--fairness must be one of {', '.join(POLICIES)}")
    if config.quota_fail_mode not in FAIL_MODES:
        raise ValueError(f"--quota-fail-mode must be one of {', '.join(FAIL_MODES)}")
    if config.ttft_target_s < 0:
        raise ValueError("--ttft-target-s must be >= 0 (0 turns early rejection off)")
    if config.tpot_target_s < 0:
        raise ValueError("--tpot-target-s must be >= 0 (0 turns the pace limit off)")
    if config.output_token_weight <= 0:
        raise ValueError("--output-token-weight must be > 0")
    for name in ("max_inflight", "max_inflight_per_key", "max_inflight_per_decode",
                 "max_prefill_queue_tokens"):
        if getattr(config, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: no limit)")
    if not 0.0 <= config.kv_headroom < 1.0:
        raise ValueError("--kv-headroom must be in [0, 1)")
    # The tenants file's own errors (unknown settings, bad digests) surface here, at start-up.
    directory_of(config)


def read_api_keys_file(path: str) -> list[str]:
    """Entries as --api-keys takes them, separated by commas or line ends; blank lines and
    lines starting with # are skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-keys-file {path!r}: {exc}") from None
    return [entry.strip() for line in text.splitlines() if not line.lstrip().startswith("#")
            for entry in line.split(",") if entry.strip()]


def directory_of(config: AdmissionSettings):
    """The tenant directory from the tenants file and the API keys (flag and file) as they
    are now: at start, and again on each reload (tenants_watch.py)."""
    # --max-inflight-per-key predates tenants: it is every tenant's default concurrency.
    defaults = {"max_concurrency": config.max_inflight_per_key} \
        if config.max_inflight_per_key else {}
    # The cluster secret, when set, keys the tenants' prefix-cache salts.
    secret_file = getattr(config, "cluster_secret_file", "")
    salt_key = read_cluster_secret(secret_file) if secret_file else None
    keys = list(config.api_keys)
    if config.api_keys_file:
        keys += read_api_keys_file(config.api_keys_file)
    return load_tenants(config.tenants_file, keys, defaults, salt_key)


def make_admission(config: AdmissionSettings, pool: WorkerPool,
                   cached_tokens: CachedTokens | None = None,
                   on_admitted: OnAdmitted | None = None) -> Admission:
    directory = directory_of(config)
    log.info("admission: %s; fairness %s (anonymous: %s); ttft target %gs; tpot target %gs; "
             "quotas %s (fail %s)", directory.describe(), config.fairness,
             config.anonymous_fairness, config.ttft_target_s,
             config.tpot_target_s,
             "shared in redis" if config.redis_url else "in process", config.quota_fail_mode)
    rule = CapacityRule(config.max_inflight, config.max_inflight_per_decode, config.kv_headroom,
                        config.max_prefill_queue_tokens, config.tpot_target_s)
    return Admission(directory, Quotas(config.redis_url, config.quota_fail_mode),
                     FairQueue(config.fairness, config.output_token_weight),
                     ClusterRoom(rule, pool), TTFTEstimator(), config.ttft_target_s,
                     cached_tokens=cached_tokens, on_admitted=on_admitted,
                     per_client=config.anonymous_fairness == "client")
