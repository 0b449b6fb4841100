"""The dispatcher against scripted workers over real gRPC: token order without repeats,
invisible retries before the first token, migration (never a retry from scratch) after it, an
error event past the migration limit, and cancellation of every RPC it opened."""

from __future__ import annotations

import asyncio
import time

import grpc
from fake_workers import (
    FIRST_TOKEN,
    FakeDecode,
    FakePrefill,
    delta,
    exhausted,
    fails_after,
    hangs,
    rejects,
    reserved,
    streams,
)
from splitserve.v1 import common_pb2

from services.gateway.errors import APIError
from services.gateway.routing.circuit_breaker import CircuitBreaker
from services.gateway.routing.dispatcher import Dispatcher
from services.gateway.routing.router import ScoringRouter
from services.gateway.routing.worker_pool import WorkerPool

SAMPLING = common_pb2.SamplingParams(max_tokens=8, seed=1, logprobs=0)


def run(decoders, prefills=(), consume=None, migration_limit: int = 3):
    """Run a request through a Dispatcher over these fakes; returns (events, error)."""

    async def scenario():
        # Polled as a gateway polls (faster): a move goes back to a worker that failed the
        # stream only once a poll begun after the failure finds it serving.
        pool = WorkerPool(prefill_addresses=[p.address for p in prefills],
                          decode_addresses=[d.address for d in decoders] if prefills else [],
                          both_addresses=[] if prefills else [d.address for d in decoders],
                          poll_interval_s=0.05)
        await pool.start()
        dispatcher = Dispatcher(ScoringRouter(pool), disaggregated=bool(prefills),
                                migration_limit=migration_limit)
        events, error = [], None
        try:
            stream = dispatcher.generate("req", [5, 6, 7], SAMPLING)
            if consume is not None:
                return await consume(stream), None
            async for event in stream:
                events.append(event)
        except APIError as exc:
            error = exc
        finally:
            await pool.close()
        return events, error

    return asyncio.run(scenario())


def tokens(events):
    return [t for e in events for t in e.token_ids]


def test_prefill_token_comes_first_then_decode_tokens(servers):
    decode = servers(FakeDecode(streams([11, 12, 13])))
    prefill = servers(FakePrefill())
    events, error = run([decode], [prefill])
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 11, 12, 13]
    assert events[-1].finish_reason == "length"
    assert decode.servicer.calls[0].remote_prefill
    assert prefill.servicer.calls[0].decode_kv_endpoint == "127.0.0.1:1"


def test_recomputed_prompt_restarts_at_index_zero_and_repeats_are_skipped(servers):
    # KV never arrived: the decode worker recomputed and streams from output index 0, whose
    # token (same seed) is the one the prefill worker already returned.
    decode = servers(FakeDecode(streams([FIRST_TOKEN, 21, 22], start_index=0)))
    events, error = run([decode], [servers(FakePrefill())])
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 21, 22]


def test_resource_exhausted_is_retried_on_another_decode_worker(servers):
    full = servers(FakeDecode(exhausted(), kv_blocks_free=900))  # chosen first: most free
    roomy = servers(FakeDecode(streams([31, 32]), kv_blocks_free=100))
    events, error = run([full, roomy], [servers(FakePrefill())])
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 31, 32]
    assert len(full.servicer.calls) == 1 and len(roomy.servicer.calls) == 1


def test_every_attempt_exhausted_is_503_with_retry_after(servers):
    only = servers(FakeDecode(exhausted()))
    events, error = run([only], [servers(FakePrefill())])
    assert events == []
    assert error.status == 503 and error.retry_after_s is not None
    assert len(only.servicer.calls) == 2  # one invisible retry, on the only worker there is


def test_prefill_failure_is_retried_and_the_first_reservation_released(servers):
    def waits_for_kv_first(request, context, fake):
        if len(fake.calls) == 1:  # the first attempt: reserved, its KV never comes
            yield from hangs()(request, context, fake)
        else:
            yield from streams([41])(request, context, fake)

    decode = servers(FakeDecode(waits_for_kv_first))
    broken = servers(FakePrefill("unavailable"))
    healthy = servers(FakePrefill())
    events, error = run([decode], [broken, healthy])
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 41]
    # Round-robin starts with the first prefill worker listed: the broken one.
    assert len(broken.servicer.calls) == 1 and len(healthy.servicer.calls) == 1
    assert len(decode.servicer.calls) == 2
    assert decode.servicer.cancelled.wait(5), "the first attempt's reservation was not released"


def resumes(token_ids):
    """A decode worker that takes a migrated request: it streams `token_ids` from the output
    index after the resumed tokens, as a real worker's resumed request does."""

    def script(request, context, fake):
        assert not request.remote_prefill, "a migrated request is recomputed on its decoder"
        start = len(request.resumed_output_token_ids)
        yield from streams(token_ids, start_index=start)(request, context, fake)
    return script


def test_failure_after_tokens_migrates_with_prompt_and_tokens_so_far(servers):
    broken = servers(FakeDecode(fails_after([51, 52]), kv_blocks_free=900))  # chosen first
    healthy = servers(FakeDecode(resumes([53, 54]), kv_blocks_free=100))
    events, error = run([broken, healthy], [servers(FakePrefill())])
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 51, 52, 53, 54]
    assert events[-1].finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    moved = healthy.servicer.calls[0]
    assert list(moved.prompt_token_ids) == [5, 6, 7]
    assert list(moved.resumed_output_token_ids) == [FIRST_TOKEN, 51, 52]
    assert moved.sampling.seed == SAMPLING.seed and moved.sampling.max_tokens == 8
    assert moved.request_id == "req-move1"
    assert len(broken.servicer.calls) == 1


def recomputed_after_the_prefill(token_ids):
    """A decode worker whose KV never came: it recomputed the prompt and streams from index 0,
    after the prefill worker has answered (so the gateway has sent that first token)."""

    def script(request, context, fake):
        yield reserved()
        time.sleep(0.3)
        for i, token in enumerate(token_ids):
            last = i == len(token_ids) - 1
            yield delta([token], i, common_pb2.FINISH_REASON_LENGTH if last else 0)
    return script


def test_a_recomputed_first_token_unlike_the_one_sent_moves_the_stream(servers):
    """The decode worker's own first token is not the prefill worker's, which the client has:
    the tokens after it follow the other one, so the stream moves, resuming after the token
    sent, and nothing of the diverged stream reaches the client."""
    diverged = servers(FakeDecode(recomputed_after_the_prefill([FIRST_TOKEN + 1, 21, 22]),
                                  kv_blocks_free=900))  # chosen first
    healthy = servers(FakeDecode(resumes([53, 54]), kv_blocks_free=100))
    events, error = run([diverged, healthy], [servers(FakePrefill())])
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 53, 54]
    assert list(healthy.servicer.calls[0].resumed_output_token_ids) == [FIRST_TOKEN]
    # The same first token (same seed, same numbers) is a repeat, skipped, as before.
    same = servers(FakeDecode(recomputed_after_the_prefill([FIRST_TOKEN, 21, 22])))
    events, error = run([same], [servers(FakePrefill())])
    assert error is None and tokens(events) == [FIRST_TOKEN, 21, 22]


def test_past_the_migration_limit_the_stream_ends_with_an_error_event(servers):
    only = servers(FakeDecode(fails_after([51])))
    events, error = run([only], [servers(FakePrefill())], migration_limit=2)
    assert error is None
    # Each move's worker streams index 1 again: a repeat, skipped.
    assert tokens(events) == [FIRST_TOKEN, 51]
    assert events[-1].finish_reason == "error" and "UNAVAILABLE" in events[-1].error
    assert len(only.servicer.calls) == 3  # the first attempt and two moves


def test_a_move_whose_worker_fails_before_its_first_token_is_not_a_move(servers):
    """Two decode workers down at once (a migration audit: both killed): the move onto the
    second, not yet known to be gone, failed before it delivered a token and counted as a
    move, so a stream used up its moves on dead workers and the metric counted each try. Such
    a try on a worker new to the stream is the same move on another worker."""
    broken = servers(FakeDecode(fails_after([51]), kv_blocks_free=900))  # chosen first
    dead = servers(FakeDecode(fails_after([]), kv_blocks_free=700))  # then this one
    healthy = servers(FakeDecode(resumes([53, 54]), kv_blocks_free=100))
    events, error = run([broken, dead, healthy], [servers(FakePrefill())], migration_limit=1)
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 51, 53, 54]
    assert events[-1].finish_reason == "length"
    assert [len(d.servicer.calls) for d in (broken, dead, healthy)] == [1, 1, 1]


def test_migration_limit_zero_ends_the_stream_with_an_error_event(servers):
    decode = servers(FakeDecode(fails_after([51, 52])))
    events, error = run([decode], [servers(FakePrefill())], migration_limit=0)
    assert error is None
    assert tokens(events) == [FIRST_TOKEN, 51, 52]
    assert events[-1].finish_reason == "error" and "UNAVAILABLE" in events[-1].error
    assert len(decode.servicer.calls) == 1


def test_invalid_argument_from_a_worker_is_a_400_without_retry(servers):
    decode = servers(FakeDecode(rejects(), role="both"))
    events, error = run([decode])
    assert error.status == 400 and "bad sampling" in error.message
    assert len(decode.servicer.calls) == 1


def test_aggregated_mode_streams_everything_from_the_decode_worker(servers):
    worker = servers(FakeDecode(streams([61, 62, 63], start_index=0), role="both"))
    events, error = run([worker])
    assert tokens(events) == [61, 62, 63]
    assert not worker.servicer.calls[0].remote_prefill


def test_cancel_during_prefill_cancels_prefill_and_decode_rpcs(servers):
    decode = servers(FakeDecode(hangs()))
    prefill = servers(FakePrefill("hang"))

    async def consume(stream):
        task = asyncio.ensure_future(anext(stream))
        while not prefill.servicer.calls:
            await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run([decode], [prefill], consume=consume)
    assert prefill.servicer.cancelled.wait(5), "the prefill RPC was not cancelled"
    assert decode.servicer.ended.wait(5), "the decode stream was not closed"


def test_closing_after_tokens_cancels_the_decode_stream(servers):
    decode = servers(FakeDecode(hangs(after_tokens=[71])))

    async def consume(stream):
        first = await anext(stream)
        second = await anext(stream)
        await stream.aclose()
        return [first, second]

    events, _ = run([decode], [servers(FakePrefill())], consume=consume)
    assert tokens(events) == [FIRST_TOKEN, 71]
    # Generous: on a loaded CI machine the server threads can see the cancel seconds late.
    assert decode.servicer.cancelled.wait(15), (
        f"the decode stream was not cancelled (its call ended: {decode.servicer.ended.is_set()})")


def test_a_migration_waits_for_a_decode_worker_to_take_work_again(servers):
    """The only other decode worker is out of rotation when the stream breaks (its breaker
    lets one trial through at a time, and one is under way): the stream waits for it, up to
    migration_wait_s, instead of ending with an error at once (a chaos audit lost 15 of 16
    streams so when a second decode worker failed)."""
    broken = servers(FakeDecode(fails_after([51, 52]), kv_blocks_free=900))  # chosen first
    back = servers(FakeDecode(resumes([53, 54]), kv_blocks_free=100))

    async def scenario(wait_s: float, reopen_after_s: float | None):
        # A failure takes a worker out of rotation (the broken one's stream ends in one).
        pool = WorkerPool(prefill_addresses=[servers(FakePrefill()).address],
                          decode_addresses=[broken.address, back.address],
                          new_breaker=lambda: CircuitBreaker(failure_threshold=1))
        await pool.poll_once()
        returning = next(e for e in pool.endpoints if e.address == back.address)
        returning.breaker.record_failure(grpc.StatusCode.UNAVAILABLE)
        dispatcher = Dispatcher(ScoringRouter(pool), migration_wait_s=wait_s)
        if reopen_after_s is not None:
            asyncio.get_running_loop().call_later(reopen_after_s, returning.breaker.record_success)
        started = time.monotonic()
        try:
            events = [e async for e in dispatcher.generate("req", [5, 6, 7], SAMPLING)]
        finally:
            await pool.close()
        return events, time.monotonic() - started

    events, _ = asyncio.run(scenario(wait_s=10.0, reopen_after_s=0.5))
    assert tokens(events) == [FIRST_TOKEN, 51, 52, 53, 54]
    assert events[-1].finish_reason == "length"
    events, took = asyncio.run(scenario(wait_s=1.0, reopen_after_s=None))
    assert events[-1].finish_reason == "error" and "no worker to migrate to" in events[-1].error
    assert 0.9 <= took < 5, took


def test_a_migrations_route_books_no_prefill_work_and_needs_no_prefill_worker(servers):
    """A move is recomputed on the decode worker alone: its route chose a prefill worker all
    the same and booked the prompt on it (its queue estimate, its breaker's one half-open
    trial), and with no prefill worker available it found no route at all."""
    prefill = servers(FakePrefill())
    decode = servers(FakeDecode(streams([51])))

    async def scenario():
        pool = WorkerPool(prefill_addresses=[prefill.address],
                          decode_addresses=[decode.address], both_addresses=[])
        await pool.poll_once()
        router = ScoringRouter(pool)  # prefill_backlog_tokens 0: new prompts wait for one
        (prefiller,), (decoder,) = pool.prefillers(), pool.decoders()
        moved = router.route(list(range(40)), 8, local="migration")
        booked = (prefiller.prefill_tokens_since_poll, decoder.prefill_tokens_since_poll)
        while prefiller.available():
            prefiller.breaker.record_failure(grpc.StatusCode.UNAVAILABLE)
        fresh = router.route(list(range(40)), 8)
        moved_again = router.route(list(range(40)), 8, local="migration")
        await pool.close()
        return moved, booked, fresh, moved_again

    moved, booked, fresh, moved_again = asyncio.run(scenario())
    assert moved.prefill is None and moved.reason == "migration"
    assert booked == (0, 40)  # the decode worker recomputes the 40 tokens
    assert fresh is None
    assert moved_again is not None and moved_again.decode.address == decode.address
