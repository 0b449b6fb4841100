"""Failover in the dispatcher and router over scripted workers (real gRPC): a decode worker
that dies while the prefill runs is retried elsewhere with the prefill cancelled and a new
request id; a draining worker's refusal takes it out of rotation at once; repeated failures
open its circuit, and after the cool-down one trial request brings it back."""

from __future__ import annotations

import asyncio
import time

import grpc
from fake_workers import FIRST_TOKEN, FakeDecode, FakePrefill, reserved, streams
from splitserve.v1 import common_pb2

from services.gateway.routing.circuit_breaker import BreakerState, CircuitBreaker
from services.gateway.routing.dispatcher import Dispatcher
from services.gateway.routing.router import ScoringRouter
from services.gateway.routing.worker_pool import WorkerPool

SAMPLING = common_pb2.SamplingParams(max_tokens=4, seed=1)


def dies_after_reserving(request, context, fake):
    yield reserved()
    time.sleep(0.1)
    context.abort(grpc.StatusCode.UNAVAILABLE, "fake: decode worker crashed")


def draining(request, context, fake):
    context.abort(grpc.StatusCode.UNAVAILABLE, "worker is draining")
    yield  # pragma: no cover


def crashing(request, context, fake):
    context.abort(grpc.StatusCode.UNAVAILABLE, "fake: connection reset")
    yield  # pragma: no cover


async def generate(dispatcher: Dispatcher, request_id: str) -> list[int]:
    return [t async for e in dispatcher.generate(request_id, [5, 6, 7], SAMPLING)
            for t in e.token_ids]


def scenario(decoders, prefills, body, breaker=CircuitBreaker):
    async def run():
        pool = WorkerPool(prefill_addresses=[p.address for p in prefills],
                          decode_addresses=[d.address for d in decoders] if prefills else [],
                          both_addresses=[] if prefills else [d.address for d in decoders],
                          new_breaker=breaker)
        await pool.poll_once()
        try:
            return await body(pool, Dispatcher(ScoringRouter(pool), prefill_timeout_s=10))
        finally:
            await pool.close()

    return asyncio.run(run())


def test_decode_death_during_prefill_is_retried_with_the_prefill_cancelled(servers):
    dying = servers(FakeDecode(dies_after_reserving, kv_blocks_free=900))  # chosen first
    healthy = servers(FakeDecode(streams([21, 22]), kv_blocks_free=100))
    slow_prefill = servers(FakePrefill("hang"))  # listed first: the first attempt's
    quick_prefill = servers(FakePrefill())

    async def body(pool, dispatcher):
        start = time.monotonic()
        tokens = await generate(dispatcher, "req")
        return tokens, time.monotonic() - start

    tokens, took = scenario([dying, healthy], [slow_prefill, quick_prefill], body)
    assert tokens == [FIRST_TOKEN, 21, 22]
    assert took < 5, "the failure was noticed only when the prefill timed out (10 s)"
    assert slow_prefill.servicer.cancelled.wait(5), "the first attempt's prefill ran on"
    ids = [c.request_id for c in dying.servicer.calls + healthy.servicer.calls]
    assert ids == ["req", "req-retry1"]


def test_a_draining_refusal_takes_the_worker_out_at_once_without_opening_its_circuit(servers):
    leaving = servers(FakeDecode(draining, role="both", kv_blocks_free=900))
    staying = servers(FakeDecode(streams([31], start_index=0), role="both", kv_blocks_free=100))

    async def body(pool, dispatcher):
        first = await generate(dispatcher, "a")
        second = await generate(dispatcher, "b")
        return first, second, pool.find(leaving.address)

    first, second, endpoint = scenario([leaving, staying], [], body)
    assert first == second == [31]
    assert len(leaving.servicer.calls) == 1, "routed again to a draining worker"
    assert endpoint.draining and endpoint.breaker.state is BreakerState.CLOSED


def test_repeated_failures_open_the_circuit_and_a_trial_after_the_cool_down_closes_it(servers):
    flaky_calls = []

    def flaky(request, context, fake):
        flaky_calls.append(request.request_id)
        if len(flaky_calls) <= 3:
            yield from crashing(request, context, fake)
        else:
            yield from streams([41], start_index=0)(request, context, fake)

    flaky_worker = servers(FakeDecode(flaky, role="both", kv_blocks_free=900))
    steady = servers(FakeDecode(streams([42], start_index=0), role="both", kv_blocks_free=100))

    async def body(pool, dispatcher):
        endpoint = pool.find(flaky_worker.address)
        outputs = [await generate(dispatcher, f"r{i}") for i in range(3)]  # each retried
        assert endpoint.breaker.state is BreakerState.OPEN
        outputs.append(await generate(dispatcher, "while-open"))
        await asyncio.sleep(0.35)  # the cool-down passes: the next request is the trial
        outputs.append(await generate(dispatcher, "trial"))
        return outputs, endpoint.breaker.state

    outputs, state = scenario([flaky_worker, steady], [], body,
                              breaker=lambda: CircuitBreaker(3, open_s=0.3))
    assert outputs == [[42], [42], [42], [42], [41]]
    assert flaky_calls == ["r0", "r1", "r2", "trial"]
    assert state is BreakerState.CLOSED


def test_a_worker_back_on_its_address_after_20_s_is_seen_within_seconds():
    """gRPC's default reconnect backoff grows toward 2 minutes: a decode worker restarted on
    its address after 27 s down was seen 16.6 s after it was ready (a chaos audit; streams
    needing it meanwhile found no worker). The gateway's channels retry every 2 s at most."""
    from fake_workers import FakeServer

    first = FakeServer(FakeDecode(streams([1])))
    address = first.address

    async def scenario() -> float:
        pool = WorkerPool(decode_addresses=[address], poll_timeout_s=0.5)
        (endpoint,) = pool.endpoints
        try:
            await pool.poll_once()
            assert endpoint.reachable
            first.stop()
            down_until = time.monotonic() + 20
            while time.monotonic() < down_until:  # the gateway polls a worker that is gone
                await pool.poll_once()
                await asyncio.sleep(0.25)
            assert not endpoint.reachable
            again = FakeServer(FakeDecode(streams([1])), address=address)
            back_at = time.monotonic()
            try:
                while not endpoint.reachable and time.monotonic() - back_at < 30:
                    await pool.poll_once()
                    await asyncio.sleep(0.1)
                return time.monotonic() - back_at
            finally:
                again.stop()
        finally:
            await pool.close()

    seen_after = asyncio.run(scenario())
    assert seen_after < 4.0, seen_after
