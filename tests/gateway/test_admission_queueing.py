"""Admission as a specification, over a scripted pool: requests wait while the cluster has no
room and leave in fair order; leaving the queue (cancel, deadline) leaves nothing behind;
a request that cannot meet its TTFT target is refused at once; tenant limits apply."""

from __future__ import annotations

import asyncio
import time

import pytest
from admission_harness import make_admission, spec

from services.gateway.admission.capacity import CapacityRule
from services.gateway.admission.tenants import Tenant
from services.gateway.errors import APIError

A, B = Tenant("a"), Tenant("b")


def run(scenario):
    return asyncio.run(scenario())


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_requests_wait_for_room_and_leave_in_fair_order():
    async def scenario():
        admission = make_admission(A, B)  # one request in flight at a time
        first = await admission.admit(A, [spec()], 10)
        order = []

        async def queued(tenant, name):
            ticket = await admission.admit(tenant, [spec()], 10)
            order.append(name)
            return ticket

        tasks = [asyncio.create_task(queued(A, "a2")), asyncio.create_task(queued(A, "a3"))]
        await settle()
        tasks.append(asyncio.create_task(queued(B, "b1")))
        await settle()
        assert order == [] and len(admission.queue) == 3 and admission.inflight == 1
        first.release()
        for _ in range(3):
            await settle()
            done = [t for t in tasks if t.done() and not t.result().done]
            for task in done:
                task.result().release()
        return order

    # A was served once already, so B (lifted to A's level, not below it) goes before a3.
    assert run(scenario) == ["a2", "b1", "a3"]


def test_a_client_leaving_the_queue_gets_its_tokens_back():
    async def scenario():
        tenant = Tenant("t", tokens_per_minute=60, burst_tokens=100)
        admission = make_admission(tenant)
        running = await admission.admit(tenant, [spec(10, 6)], 10)  # charged 16
        waiting = asyncio.create_task(admission.admit(tenant, [spec(10, 6)], 10))
        await settle()
        assert len(admission.queue) == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert len(admission.queue) == 0 and admission.inflight == 1
        running._tokens(1)  # its first token
        running._tokens(2)
        running.release()  # used 10 + 3 of the 16
        bucket = admission.quotas.local._buckets["t"]
        return bucket.tokens, admission.inflight

    tokens, inflight = run(scenario)
    assert tokens == pytest.approx(100 - 13, abs=0.5) and inflight == 0


def test_a_queued_request_past_its_deadline_is_dropped_with_503():
    async def scenario():
        admission = make_admission(A, ttft_target_s=0.15)
        await admission.start()
        holder = await admission.admit(A, [spec()], 10)
        start = time.monotonic()
        with pytest.raises(APIError) as dropped:
            await admission.admit(A, [spec()], 10)
        waited = time.monotonic() - start
        holder.release()
        await admission.close()
        return dropped.value, waited, len(admission.queue)

    error, waited, left = run(scenario)
    assert error.status == 503 and error.code == "ttft_deadline_passed" and error.retry_after_s
    assert 0.1 < waited < 0.5 and left == 0


def test_a_request_that_cannot_be_on_time_is_refused_at_once():
    async def scenario():
        admission = make_admission(A, ttft_target_s=1.0)
        admission.estimator.requests_per_s = 2.0  # measured: two queued requests leave per s
        admission.estimator.tokens_per_s = 1000.0
        holder = await admission.admit(A, [spec()], 10)
        waiting = [asyncio.create_task(admission.admit(A, [spec()], 10)) for _ in range(3)]
        await settle()
        start = time.monotonic()
        with pytest.raises(APIError) as refused:
            await admission.admit(A, [spec()], 10)  # 3 ahead + itself at 2/s: 2 s
        elapsed = time.monotonic() - start
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        holder.release()
        return refused.value, elapsed

    error, elapsed = run(scenario)
    assert error.status == 503 and error.code == "ttft_unattainable"
    assert error.retry_after_s == 1 and elapsed < 0.05


def test_a_light_tenant_is_not_refused_for_a_heavy_tenants_backlog():
    async def scenario():
        admission = make_admission(A, B, ttft_target_s=1.0)
        admission.estimator.requests_per_s = 8.0
        holder = await admission.admit(A, [spec()], 10)
        waiting = [asyncio.create_task(admission.admit(A, [spec()], 10)) for _ in range(8)]
        await settle()
        assert len(admission.queue) == 8
        with pytest.raises(APIError):
            await admission.admit(A, [spec()], 10)  # behind A's own 8, at 8/s: 1.125 s
        b = asyncio.create_task(admission.admit(B, [spec()], 10))  # behind at most one of A's
        await settle()
        admitted = not b.done() and len(admission.queue) == 9
        for task in [*waiting, b]:
            task.cancel()
        await asyncio.gather(*waiting, b, return_exceptions=True)
        holder.release()
        return admitted

    assert run(scenario)


def test_tenant_limits_queue_length_prompt_and_output():
    async def scenario():
        tenant = Tenant("t", max_queued=1, max_prompt_tokens=20, max_output_tokens=4)
        admission = make_admission(tenant)
        with pytest.raises(APIError) as too_long:
            await admission.admit(tenant, [spec(prompt_tokens=21)], 21)
        ticket = await admission.admit(tenant, [spec(max_tokens=100)], 10)
        waiting = asyncio.create_task(admission.admit(tenant, [spec()], 10))
        await settle()
        with pytest.raises(APIError) as queue_full:
            await admission.admit(tenant, [spec()], 10)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        ticket.release()
        return too_long.value, queue_full.value, ticket

    too_long, queue_full, ticket = run(scenario)
    assert too_long.status == 400 and too_long.code == "prompt_too_long"
    assert queue_full.status == 429 and queue_full.retry_after_s
    assert ticket.specs[0].params.max_tokens == 4 and ticket.reserved_tokens == 14


def test_concurrency_quota_counts_queued_and_running_requests():
    async def scenario():
        tenant = Tenant("t", max_concurrency=2)
        admission = make_admission(tenant)
        running = await admission.admit(tenant, [spec()], 10)
        waiting = asyncio.create_task(admission.admit(tenant, [spec()], 10))
        await settle()
        with pytest.raises(APIError) as refused:
            await admission.admit(tenant, [spec()], 10)
        running.release()
        await settle()
        (await waiting).release()
        return refused.value

    error = run(scenario)
    assert error.status == 429 and error.type == "rate_limit_error"


def test_metrics_report_decisions_per_tenant():
    from prometheus_client import generate_latest

    async def scenario():
        tenant = Tenant("t", max_concurrency=1)
        admission = make_admission(tenant)
        ticket = await admission.admit(tenant, [spec()], 10)
        with pytest.raises(APIError):
            await admission.admit(tenant, [spec()], 10)
        ticket._tokens(4)
        ticket.release()
        return generate_latest(admission.metrics.registry).decode()

    text = run(scenario)
    assert 'splitserve_gateway_rejected_requests_total{reason="quota_concurrency",tenant="t"} 1.0' in text
    assert 'splitserve_gateway_served_tokens_total{kind="output",tenant="t"} 4.0' in text
    assert "splitserve_gateway_quota_shared 0.0" in text


def test_a_request_larger_than_the_rule_still_runs_alone():
    async def scenario():
        from admission_harness import FakeEndpoint, FakePool

        pool = FakePool(FakeEndpoint(kv_free=2, kv_total=100))
        admission = make_admission(A, rule=CapacityRule(), pool=pool)
        ticket = await asyncio.wait_for(admission.admit(A, [spec(100, 100)], 100), 1)
        ticket.release()
        return True

    assert run(scenario)


def test_a_tenant_back_from_idle_gets_its_share_of_slots_without_waiting():
    async def scenario():
        admission = make_admission(A, B, rule=CapacityRule(max_inflight=4))
        running = [await admission.admit(A, [spec()], 10) for _ in range(4)]  # A holds them all
        waiting = [asyncio.create_task(admission.admit(A, [spec()], 10)) for _ in range(3)]
        await settle()
        b1 = await asyncio.wait_for(admission.admit(B, [spec()], 10), 1)  # at once: owed
        b2 = await asyncio.wait_for(admission.admit(B, [spec()], 10), 1)  # its share is 2
        b3 = asyncio.create_task(admission.admit(B, [spec()], 10))
        await settle()
        over_limit = admission.inflight
        b3_waits = not b3.done()
        running[0].release()  # 5 in flight: still over the limit, nothing is released
        await settle()
        a_waits = all(not t.done() for t in waiting) and not b3.done()
        for ticket in [*running, b1, b2]:
            ticket.release()
        for task in [*waiting, b3]:
            task.cancel()
        await asyncio.gather(*waiting, b3, return_exceptions=True)
        return over_limit, b3_waits, a_waits

    assert run(scenario) == (6, True, True)


def test_owed_slots_stop_at_the_share_then_the_policy_decides():
    async def scenario():
        admission = make_admission(A, B, rule=CapacityRule(max_inflight=2))
        running = [await admission.admit(A, [spec()], 10) for _ in range(2)]
        a_waiting = [asyncio.create_task(admission.admit(A, [spec()], 10)) for _ in range(2)]
        b_waiting = [asyncio.create_task(admission.admit(B, [spec()], 10)) for _ in range(3)]
        await settle()
        # B's first request was owed its one slot; its others wait like A's.
        state = (admission.inflight, [t.done() for t in b_waiting])
        running[0].release()  # back at the limit: nothing more is released
        await settle()
        still = [t.done() for t in [*a_waiting, *b_waiting]]
        running[1].release()  # under it: the policy picks A (B was lifted to A's level, then served)
        await settle()
        picked = [t.done() for t in [*a_waiting, *b_waiting]]
        for task in [*a_waiting, *b_waiting]:
            if task.done():
                task.result().release()
            task.cancel()
        await asyncio.gather(*a_waiting, *b_waiting, return_exceptions=True)
        return state, still, picked

    state, still, picked = run(scenario)
    assert state == (3, [True, False, False])
    assert still == [False, False, True, False, False]
    assert picked == [True, False, True, False, False]


def test_a_bursts_refusals_are_told_to_come_back_spread_at_the_drain_rate():
    """Each refusal's Retry-After comes after the ones told before it, spaced by the measured
    time per request, not all "1": the OpenAI SDK's two retries of a burst's refusals then land
    as the cluster frees, instead of together a second later."""
    async def scenario():
        admission = make_admission(A, ttft_target_s=1.0)
        admission.estimator.requests_per_s = 2.0  # two queued requests leave per second
        admission.estimator.tokens_per_s = 1000.0
        holder = await admission.admit(A, [spec()], 10)
        waiting = [asyncio.create_task(admission.admit(A, [spec()], 10)) for _ in range(3)]
        await settle()
        retries = []
        for _ in range(6):
            with pytest.raises(APIError) as refused:
                await admission.admit(A, [spec()], 10)
            retries.append(refused.value.retry_after_s)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        holder.release()
        return retries

    retries = run(scenario)
    # The first as soon as the backlog allows; each after by half a second (rounded up to
    # whole seconds as the header has them), never sooner than the one before.
    assert retries[0] == 1 and retries == sorted(retries) and retries[-1] >= 3, retries


def test_the_retry_schedule_forgets_refusals_long_past():
    from services.gateway.admission.retry_after import MAX_RETRY_AFTER_S, RetrySchedule

    now = [100.0]
    schedule = RetrySchedule(clock=lambda: now[0])
    assert [schedule.retry_after_s(0.2, 0.5) for _ in range(5)] == [1, 1, 2, 2, 3]
    now[0] += 30  # all of them came back and were served
    assert schedule.retry_after_s(0.2, 0.5) == 1
    assert schedule.retry_after_s(500, 0.5) == MAX_RETRY_AFTER_S


def test_a_retry_storm_does_not_hold_everyone_back_once_there_is_room():
    """A client retrying 50 ms after each refusal, ignoring Retry-After, was refused 2,308
    times in 15 s; every refusal pushed the schedule on by the cluster's time per request, so
    for minutes after, with the cluster idle again, everyone was told 60 s. The schedule now
    never runs past what it can say, and a request that finds room clears it."""
    from services.gateway.admission.retry_after import MAX_RETRY_AFTER_S, RetrySchedule

    now = [100.0]
    schedule = RetrySchedule(clock=lambda: now[0])
    for _ in range(2308):
        schedule.retry_after_s(0.2, 0.5)
        now[0] += 0.0065
    assert schedule.retry_after_s(0.2, 0.5) == MAX_RETRY_AFTER_S
    now[0] += MAX_RETRY_AFTER_S  # the storm stopped a minute ago: nothing is owed any more
    assert schedule.retry_after_s(0.2, 0.5) == 1
    for _ in range(200):
        schedule.retry_after_s(0.2, 0.5)
    assert schedule.retry_after_s(0.2, 0.5) == MAX_RETRY_AFTER_S
    schedule.room()  # a request was admitted at once: a new burst is spread from now
    assert [schedule.retry_after_s(0.2, 0.5) for _ in range(3)] == [1, 1, 2]


def test_a_request_admitted_with_room_clears_the_retry_schedule():
    async def scenario():
        admission = make_admission(A, ttft_target_s=1.0)
        admission.retry_schedule._next = time.monotonic() + 45  # a storm's refusals before
        ticket = await admission.admit(A, [spec()], 10)  # an idle cluster: room at once
        ticket.release()
        return admission.retry_schedule.retry_after_s(0.2, 0.5)

    assert run(scenario) == 1


def test_requests_in_preparation_count_against_a_tenants_queue_limit():
    """Parsing, tokenizing and a constraint's compile run before admit(): a tenant with a
    queue limit has at most max_concurrency + max_queued requests there and in the queue
    together, so one over it is refused before the gateway spends CPU on it; other tenants
    and tenants without a queue limit are not held."""
    async def scenario():
        limited, other, free = Tenant("t", max_queued=2), Tenant("o", max_queued=2), Tenant("f")
        admission = make_admission(limited, other, free)
        with admission.preparing(limited), admission.preparing(limited):
            with pytest.raises(APIError) as refused, admission.preparing(limited):
                pass
            with admission.preparing(other), admission.preparing(free):
                for _ in range(5):
                    with admission.preparing(free):
                        pass
        # Prepared and gone: the queue is what counts again.
        ticket = await admission.admit(limited, [spec()], 10)  # runs (max_inflight 1)
        waiting = asyncio.create_task(admission.admit(limited, [spec()], 10))
        await settle()
        with admission.preparing(limited):  # one queued, one preparing: 2, the limit
            with pytest.raises(APIError), admission.preparing(limited):
                pass
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        ticket.release()
        return refused.value, admission.metrics

    refused, metrics = run(scenario)
    assert refused.status == 429 and refused.retry_after_s and refused.rejected_by == "queue_full"
    assert metrics.rejected.labels("t", "queue_full")._value.get() == 2
