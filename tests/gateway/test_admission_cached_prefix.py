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


SHARED = 512  # prompt tokens: a new 496-token prefix and 16 of their own


def _shared_prefix_specs(n: int, tail: int = 16) -> list:
    """n prompts of SHARED tokens: one new prefix, then `tail` tokens of their own."""
    from engine.sampling_params import SamplingParams
    from services.gateway.generation_spec import GenerationSpec

    prefix = tuple(range(1000, 1000 + SHARED - tail))
    return [GenerationSpec(f"req-{i}", 0, prefix + tuple(range(5 + tail * i, 5 + tail * (i + 1))),
                           SamplingParams(max_tokens=4, seed=1)) for i in range(n)]


def test_prompts_sharing_a_prefix_admitted_a_moment_ago_count_it_as_cached():
    """Sixteen prompts of 512 tokens behind one new prefix (a system prompt no worker holds yet),
    sent at once, over a real PrefixIndex: the first is judged by its whole length (0.5 s
    here), the others by their own 16 tokens behind it, since the worker computes the prefix once (the first prompt's step
    holds it alone, the others find it cached). Without the record of admitted prompts each was
    judged by its whole length behind the others and 15 were refused (the `make run` check: 10
    of 12 cold chats refused that, with the TTFT target off, got first tokens in 0.34-0.62 s).
    The record fades after admitted_ttl_s."""
    from functools import partial

    from services.gateway.routing.router import note_admitted_prompt

    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0], admitted_ttl_s=5.0)
    pool = FakePool(_Worker("w"))

    async def admit_all(admission: Admission, specs: list) -> tuple[list, list]:
        """All at once, as a burst's requests reach admission together."""
        results = await asyncio.gather(*(asyncio.wait_for(admission.admit(A, [s], SHARED), 1.0)
                                         for s in specs), return_exceptions=True)
        return ([r for r in results if not isinstance(r, BaseException)],
                [r for r in results if isinstance(r, APIError)])

    def build(record: bool) -> Admission:
        admission = _admission(partial(cached_prompt_tokens, index, pool))
        if record:
            admission.on_admitted = partial(note_admitted_prompt, index, pool)
        return admission

    admitted, refused = asyncio.run(admit_all(build(True), _shared_prefix_specs(16)))
    assert len(admitted) == 16 and not refused
    assert [t.prefill_tokens for t in admitted] == [SHARED] + [16] * 15
    now[0] += 6.0  # past the TTL, with nothing routed: the prefix is not known to be cached
    assert cached_prompt_tokens(index, pool, _shared_prefix_specs(1)[0].prompt_token_ids) == 0
    admitted, refused = asyncio.run(admit_all(build(False), _shared_prefix_specs(16)))
    assert len(admitted) == 1 and len(refused) == 15
