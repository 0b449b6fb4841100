"""What a quota store answers (Decision) and the protocol both stores implement: LocalQuota
(quota.py, in process) and RedisQuota (redis_quota.py, shared). A leaf, so neither store module
imports the other for the type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from services.gateway.admission.tenants import Tenant


@dataclass(frozen=True)
class Decision:
    admitted: bool
    reason: str = ""  # "tokens" or "concurrency" when refused
    retry_after_s: float = 0.0


class QuotaStore(Protocol):
    async def acquire(self, tenant: Tenant, tokens: int, lease_id: str,
                      share: float) -> Decision:
        """Take `tokens` from the bucket and one concurrency slot, both or neither. `share`
        scales the tenant's limits (a replica's part of them while Redis is away)."""

    async def release(self, tenant: Tenant, lease_id: str, refund: int, share: float) -> None:
        """Give the slot back and return `refund` unused tokens to the bucket."""
