"""In-process quotas (no Redis): a token bucket charged prompt + max_tokens and refunded what
was not generated, a concurrency counter, and 429s whose Retry-After comes from the bucket."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.admission.quota import LocalQuota, Quotas
from services.gateway.admission.tenants import Tenant
from services.gateway.errors import APIError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bucket_refills_at_the_rate_and_says_how_long_to_wait():
    clock = Clock()
    quota = LocalQuota(clock)
    tenant = Tenant("t", tokens_per_minute=600, burst_tokens=100)  # 10 tokens/s
    assert quota.take(tenant, 80, "l1").admitted
    refused = quota.take(tenant, 50, "l2")
    assert not refused.admitted and refused.reason == "tokens"
    assert refused.retry_after_s == pytest.approx(3.0)  # 30 tokens short at 10/s
    clock.now = 3.0
    assert quota.take(tenant, 50, "l2").admitted
    clock.now = 1000.0
    assert quota.take(tenant, 100, "l3").admitted  # refills to the bucket size, no further
    assert not quota.take(tenant, 1, "l4").admitted


def test_unused_reservation_is_refunded():
    quota = LocalQuota(Clock())
    tenant = Tenant("t", tokens_per_minute=60, burst_tokens=100)
    assert quota.take(tenant, 100, "l1").admitted
    quota.give(tenant, "l1", refund=70)  # generated 30 of the 100 reserved
    assert quota.take(tenant, 70, "l2").admitted
    assert not quota.take(tenant, 1, "l3").admitted


def test_concurrency_counts_requests_until_released():
    quota = LocalQuota(Clock())
    tenant = Tenant("t", max_concurrency=2)
    assert quota.take(tenant, 5, "l1").admitted and quota.take(tenant, 5, "l2").admitted
    refused = quota.take(tenant, 5, "l3")
    assert not refused.admitted and refused.reason == "concurrency"
    quota.give(tenant, "l1", 0)
    assert quota.take(tenant, 5, "l3").admitted


def test_a_share_scales_every_limit():
    quota = LocalQuota(Clock())
    tenant = Tenant("t", tokens_per_minute=600, burst_tokens=100, max_concurrency=4)
    assert quota.take(tenant, 50, "l1", share=0.5).admitted
    assert not quota.take(tenant, 1, "l2", share=0.5).admitted  # bucket of 50
    assert quota.take(Tenant("u", max_concurrency=4), 1, "m1", share=0.5).admitted


def test_over_quota_is_429_with_retry_after_and_openai_body():
    async def scenario():
        quotas = Quotas()
        tenant = Tenant("t", tokens_per_minute=60, burst_tokens=100)  # 1 token/s
        lease = await quotas.acquire(tenant, 90)
        with pytest.raises(APIError) as refused:
            await quotas.acquire(tenant, 40)
        quotas.release(lease, used_tokens=90)
        return refused.value

    error = asyncio.run(scenario())
    assert error.status == 429 and error.type == "rate_limit_error"
    assert 29 <= error.retry_after_s <= 31  # 30 tokens short at 1 token/s
    assert error.headers() == {"Retry-After": str(error.retry_after_s)}
    assert error.body()["error"]["code"] == "rate_limit_exceeded"


def test_a_bursts_token_refusals_are_told_to_come_back_one_after_another():
    """16 requests of 107 tokens at once against a 1,000-token bucket refilling 50 tokens a
    second: 9 fit. The 7 refused were all told `Retry-After: 2` (a fairness audit), when the
    bucket holds one more of them; each is now told when the tokens of those before it will
    have come, and an admission starts the count again."""
    tenant = Tenant("t", tokens_per_minute=3000, burst_tokens=1000)

    async def scenario():
        quotas = Quotas()
        leases, retries = [], []
        for _ in range(16):
            try:
                leases.append(await quotas.acquire(tenant, 107))
            except APIError as refused:
                retries.append(refused.retry_after_s)
        quotas.release(leases[0], 0)  # refunded whole: the next one fits
        leases.append(await quotas.acquire(tenant, 107))
        with pytest.raises(APIError) as again:
            await quotas.acquire(tenant, 107)
        return len(leases), retries, again.value.retry_after_s

    admitted, retries, after_room = asyncio.run(scenario())
    assert admitted == 10 and len(retries) == 7
    assert retries == sorted(retries) and len(set(retries)) == 7, retries
    assert retries[0] <= 2 and retries[-1] >= 13, retries  # 107 tokens at 50/s: ~2.1 s apart
    assert after_room <= 2


def test_a_request_larger_than_the_bucket_is_refused_for_good():
    async def scenario():
        with pytest.raises(APIError) as refused:
            await Quotas().acquire(Tenant("t", tokens_per_minute=600, burst_tokens=100), 101)
        return refused.value

    error = asyncio.run(scenario())
    assert error.status == 429 and error.code == "request_exceeds_token_limit"
    # The OpenAI SDK retried it twice for nothing (a fairness audit): it obeys this header.
    assert error.headers() == {"x-should-retry": "false"}


def test_tenants_without_limits_touch_no_store():
    async def scenario():
        quotas = Quotas()
        lease = await quotas.acquire(Tenant("free"), 10**9)
        quotas.release(lease, 0)
        return lease

    assert asyncio.run(scenario()).store is None
