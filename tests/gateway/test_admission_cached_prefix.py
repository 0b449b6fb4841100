"""The TTFT estimate counts what a prefill computes: a prompt whose prefix a worker already
holds (a system prompt, a chat's earlier turns) is judged by its uncached tokens, not refused
for the seconds its whole length would take. The estimate of what is cached comes from the
gateway's prefix index (cached_prompt_tokens), checked here over a real PrefixIndex.

Admission runs over the scripted pool of admission_harness (no processes); the scenario on a
real deployment is bench/admission_prefix.py."""

from __future__ import annotations

import asyncio

import pytest
from admission_harness import FakeEndpoint, FakePool, spec

from engine.block_pool import hash_prompt_blocks
from services.gateway.admission.admission import Admission
from services.gateway.admission.capacity import CapacityRule, ClusterRoom
from services.gateway.admission.fair_queue import FairQueue
from services.gateway.admission.quota import Quotas
from services.gateway.admission.tenants import Tenant, TenantDirectory
from services.gateway.admission.ttft_estimator import TTFTEstimator
from services.gateway.errors import APIError
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.router import cached_prompt_tokens

A = Tenant("a")
PROMPT = 1024


def _admission(cached_tokens=None) -> Admission:
    """Room for 16 at once; an estimator that has learned 1 ms per prompt token to prefill
    (first tokens of 64 to 2,048 tokens ahead, trusted)."""
    directory = TenantDirectory([A], {"a-digest": "a"})
    estimator = TTFTEstimator()
    for _ in range(20):
        for tokens in (64, 512, 1024, 2048):
            estimator.first_token(tokens / 1000, prefill_tokens=tokens)
    assert estimator.trusted and estimator.service_at(1000) == pytest.approx(1.0, abs=0.05)
    return Admission(directory, Quotas(), FairQueue("vtc"),
                     ClusterRoom(CapacityRule(max_inflight=16),
                                 FakePool(FakeEndpoint(kv_free=10_000, kv_total=10_000))),
                     estimator, 1.0,
                     cached_tokens=cached_tokens)


async def _sixteen(admission: Admission) -> tuple[list, list[APIError]]:
    admitted, refused = [], []
    for i in range(16):
        try:
            admitted.append(await asyncio.wait_for(
                admission.admit(A, [spec(PROMPT, 4, index=i)], PROMPT), 1.0))
        except APIError as exc:
            refused.append(exc)
    return admitted, refused


def test_prompts_with_a_cached_prefix_are_judged_by_their_uncached_tokens():
    """16 prompts of 1,024 tokens sharing a cached prefix of 1,008 at once: each prefills 16
    tokens, all 16 together 256 (about 0.26 s here), so all are admitted; judged by their
    whole length (no estimate), the second already predicts 2 s and 15 are refused."""
    admitted, refused = asyncio.run(_sixteen(_admission(lambda prompt, salt: PROMPT - 16)))
    assert len(admitted) == 16 and not refused
    assert [t.prefill_tokens for t in admitted] == [16] * 16
    assert all(t.deadline - t.arrival == pytest.approx(1.0) for t in admitted)

    admitted, refused = asyncio.run(_sixteen(_admission()))
    assert len(admitted) == 1 and len(refused) == 15
    assert admitted[0].prefill_tokens == PROMPT
    assert all(e.status == 503 and e.code == "ttft_unattainable" for e in refused)


def test_an_uncached_prompt_is_still_judged_by_its_whole_length():
    """What nothing caches costs all its tokens, and the refusal says how many were not cached
    when some were."""
    admitted, refused = asyncio.run(_sixteen(_admission(lambda prompt, salt: 0)))
    assert len(admitted) == 1 and len(refused) == 15
    admitted, refused = asyncio.run(_sixteen(_admission(lambda prompt, salt: 256)))
    assert len(admitted) == 1 and "768 of its tokens not cached" in str(refused[0])


def test_a_cached_estimate_never_leaves_less_than_one_token_to_prefill():
    admitted, _ = asyncio.run(_sixteen(_admission(lambda prompt, salt: 10 * PROMPT)))
    assert [t.prefill_tokens for t in admitted] == [1] * 16


class _Worker(FakeEndpoint):
    def __init__(self, worker_id: str, role: str = "both") -> None:
        super().__init__(role)
        self.worker_id = worker_id
        self.address = f"{worker_id}:50051"


def test_cached_prompt_tokens_reads_the_prefix_index_of_the_workers_that_may_prefill():
    """Over a real PrefixIndex: the blocks routed to (or stored on) a worker count, only under
    the same cache salt, only on available workers, and the best worker's count is taken."""
    index = PrefixIndex()
    a, b = _Worker("a"), _Worker("b")
    pool = FakePool(a, b)
    prompt = list(range(100, 100 + 80))  # 5 blocks of 16
    index.record_routed(a.address, hash_prompt_blocks(prompt[:32], 16, ""))  # 2 blocks on a
    index.apply_event(b.worker_id, "stored", hash_prompt_blocks(prompt[:64], 16, ""))  # 4 on b
    assert cached_prompt_tokens(index, pool, prompt + [7, 8, 9]) == 64
    assert cached_prompt_tokens(index, pool, prompt, cache_salt="tenant-b") == 0
    b.up = False
    assert cached_prompt_tokens(index, pool, prompt) == 32
    index.apply_event(a.worker_id, "evicted", [])  # a now publishes events: history fades
    assert cached_prompt_tokens(index, pool, [1] * 40) == 0
    assert cached_prompt_tokens(index, FakePool(_Worker("p", "prefill"), _Worker("d", "decode")),
                                prompt) == 0
    assert cached_prompt_tokens(index, pool, []) == 0
