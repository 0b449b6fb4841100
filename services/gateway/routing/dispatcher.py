"""Runs one request on the workers and yields its tokens, hiding the flow (disaggregated or
aggregated), retries before the first token, migration after it, and cancellation of every
RPC it opened.

Runs on the gateway's event loop. Closing the generator (client gone, stop string matched,
slow client cut off) cancels the open Decode.Generate and Prefill.Prefill calls, which makes
the workers abort the request and free its KV blocks. Nested generators are closed explicitly
(`aclosing`): left to the garbage collector, a cancel could come seconds late.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import grpc
from splitserve.v1 import common_pb2, decode_pb2, prefill_pb2

from services.common import convert
from services.gateway.errors import APIError, from_worker_error
from services.gateway.routing.decode_stream import (
    AttemptFailed,
    TokenEvent,
    decode_events,
    prompt_logprobs,
    read_message,
    synthetic_error,
)
from services.gateway.routing.router import Route, Router

log = logging.getLogger(__name__)

_NOT_ON_THE_WORKER = (grpc.StatusCode.INVALID_ARGUMENT,)  # retrying elsewhere cannot help
# The error code of a stream that broke and found no decode worker to move to.
NO_WORKER = "no_worker"


class AttemptObserver(Protocol):
    """Who watches one request's attempts (request_record.RequestRecord): where each went,
    what its prefill reported, and the trace context its worker RPCs carry."""

    grpc_metadata: Sequence[tuple[str, str]]

    def routed(self, route: Route, attempt: int) -> None: ...

    def prefilled(self, kv_bytes: int, cached_tokens: int) -> None: ...

    def migrating(self, reason: str, worker: str, move: int, resumed_tokens: int) -> None:
        """The stream on `worker` broke after `resumed_tokens` tokens; move `move` starts."""

    def resumed(self) -> None:
        """The first token after the latest move arrived."""

    def migration_failed(self, reason: str) -> None:
        """A broken stream could not move (limit reached, nowhere to go): it ends in error."""


class _Unobserved:
    grpc_metadata: Sequence[tuple[str, str]] = ()

    def routed(self, route: Route, attempt: int) -> None:
        pass

    def prefilled(self, kv_bytes: int, cached_tokens: int) -> None:
        pass

    def migrating(self, reason: str, worker: str, move: int, resumed_tokens: int) -> None:
        pass

    def resumed(self) -> None:
        pass

    def migration_failed(self, reason: str) -> None:
        pass


_UNOBSERVED = _Unobserved()


@dataclass
class Dispatcher:
    router: Router
    disaggregated: bool = True  # False: never use a prefill worker, whatever the router says
    prefill_timeout_s: float = 120.0
    max_attempts: int = 2  # the first try and one invisible retry before any token is out
    # Moves of a request whose stream broke after tokens were sent (0: it ends with an error).
    migration_limit: int = 3
    # A broken stream waits this long for a decode worker to move to (one restarting, one
    # whose circuit breaker still lets a single trial through) before it ends with an error.
    migration_wait_s: float = 10.0
    # Tries of one move that may fail before they deliver a token, each on a worker new to
    # the stream (one that died and is not yet known to be gone): they are not moves. Counted
    # as moves, two decode workers killed together spent a stream's moves on each other, and
    # the migrations metric counted 8 moves for 3 streams (a migration audit).
    move_tries: int = 3

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: common_pb2.SamplingParams,
        observer: AttemptObserver = _UNOBSERVED, cache_salt: str = "",
    ) -> AsyncIterator[TokenEvent]:
        """Tokens of one request. Raises APIError if it fails before any token came back.
        After that a broken stream is migrated: another decode worker recomputes prompt plus
        every token sent so far (same seed, same positions) and the tokens go on from there,
        up to `migration_limit` moves; past it, one final event with finish_reason "error".
        `cache_salt` (the tenant's) goes to both workers and into the router's block hashes."""
        # Workers that failed this request -> when (its keys: those tried, which the router
        # avoids where it can).
        failed_at: dict[str, float] = {}
        last: AttemptFailed | None = None
        sent: list[int] = []  # every token yielded so far, across attempts
        attempt = moves = 0
        unlanded = 0  # tries of the current move that failed before delivering a token
        while True:
            resumed = tuple(sent)
            attempt_id = (f"{request_id}-move{moves}" + (f".{unlanded}" if unlanded else "")
                          if resumed
                          else request_id if attempt == 0 else f"{request_id}-retry{attempt}")
            if len(resumed) >= sampling.max_tokens:  # broke after its last token
                yield TokenEvent(finish_reason="length")
                return
            awaiting_resume = bool(resumed)
            try:
                async with aclosing(self._attempt(attempt_id, prompt_token_ids, resumed,
                                                  sampling, attempt, observer, cache_salt,
                                                  failed_at)) as events:
                    async for event in events:
                        if awaiting_resume and event.token_ids:
                            awaiting_resume = False
                            observer.resumed()
                        sent.extend(event.token_ids)
                        yield event
                return
            except AttemptFailed as failed:
                code = failed.error.code()
                failed.endpoint.record_failure(failed.error)
                first_failure_there = failed.endpoint.address not in failed_at
                failed_at[failed.endpoint.address] = time.monotonic()
                if sent and awaiting_resume and first_failure_there \
                        and code not in _NOT_ON_THE_WORKER and unlanded + 1 < self.move_tries:
                    # This move's worker, new to this stream, failed before its first token:
                    # the same move, on another worker (the router prefers one not tried). A
                    # worker that failed this stream before counts as a move, as always.
                    unlanded += 1
                    log.info("request %s: move %d onto %s failed before its first token "
                             "(%s); trying another worker", request_id, moves,
                             failed.endpoint.address, code.name)
                    continue
                if sent:
                    unlanded = 0
                    reason = _migration_reason(failed.error)
                    if moves >= self.migration_limit or code in _NOT_ON_THE_WORKER:
                        log.warning("request %s failed after %d tokens (%s %s); %s", request_id,
                                    len(sent), code.name, failed.error.details(),
                                    f"migration limit {self.migration_limit} reached"
                                    if code not in _NOT_ON_THE_WORKER else "not migratable")
                        observer.migration_failed(reason)
                        # The client's message names no worker (the log above does): the
                        # cluster's addresses are not the caller's business.
                        yield TokenEvent(finish_reason="error", error=(
                            f"the request was refused mid-generation: {failed.error.details()}"
                            if code in _NOT_ON_THE_WORKER else
                            f"a worker failed mid-generation ({code.name}) and the stream "
                            f"could not move again (migration limit {self.migration_limit})"))
                        return
                    moves += 1
                    log.info("request %s: stream on %s broke after %d tokens (%s: %s); "
                             "migrating (move %d of at most %d)", request_id,
                             failed.endpoint.address, len(sent), code.name,
                             failed.error.details(), moves, self.migration_limit)
                    observer.migrating(reason, failed.endpoint.address, moves, len(sent))
                    continue
                if code in _NOT_ON_THE_WORKER:
                    raise from_worker_error(failed.error) from None
                log.info("request %s attempt %d on %s failed before its first token (%s); %s",
                         request_id, attempt, failed.endpoint.address, code.name,
                         "retrying" if attempt + 1 < self.max_attempts else "giving up")
                # The retry prefers another worker, but uses the same one if it is the only
                # one (the health poll and the circuit breaker decide that a worker is gone).
                last = failed
                attempt += 1
                if attempt >= self.max_attempts:
                    raise from_worker_error(last.error) from None
            except APIError as exc:
                if not sent:
                    raise
                # No worker to move to: the stream ends as past the migration limit.
                observer.migration_failed("no_worker")
                yield TokenEvent(finish_reason="error", error_code=NO_WORKER,
                                 error=f"no worker to migrate to: {exc.message}")
                return

    async def _migration_route(self, tokens: list[int], max_tokens: int, cache_salt: str,
                               failed_at: dict[str, float]) -> Route | None:
        """A decode worker for a stream the client already has part of (the router prefers
        one it has not tried, else one that takes work again), waiting up to migration_wait_s
        for one. A stall of seconds beats an error mid-answer: with no wait, when a second
        decode worker failed while the first was back but its breaker let one trial through at
        a time, 15 of 16 streams ended in an error (a chaos audit). Never a worker that failed
        this stream and has not been found serving by a Health poll begun since: the one just
        killed still looked available until its breaker opened, and a stream spent its three
        moves on it in 4 ms instead of waiting for it to restart (a migration audit)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.migration_wait_s
        while True:
            route = self.router.route(tokens, max_tokens, exclude=failed_at,
                                      cache_salt=cache_salt, local="migration",
                                      failed_at=failed_at)
            if route is not None or loop.time() >= deadline:
                return route
            await asyncio.sleep(0.1)

    async def _attempt(self, request_id, prompt, resumed: tuple[int, ...], sampling,
                       attempt: int, observer: AttemptObserver, cache_salt: str,
                       failed_at: dict[str, float]) -> AsyncIterator[TokenEvent]:
        """One try on one decode worker. `resumed`: tokens already sent (a migration), which
        that worker recomputes after the prompt itself: no prefill worker is involved."""
        tokens = [*prompt, *resumed]
        max_tokens = sampling.max_tokens - len(resumed)
        route = (await self._migration_route(tokens, max_tokens, cache_salt, failed_at)
                 if resumed
                 else self.router.route(tokens, max_tokens, exclude=failed_at,
                                        cache_salt=cache_salt))
        if route is None:
            raise APIError.overloaded("No prefill/decode worker is available right now; retry.")
        observer.routed(route, attempt)
        decode, prefill = route.decode, route.prefill if self.disaggregated else None
        decode.outstanding += 1
        try:
            if prefill is None:
                flow = self._aggregated(decode, request_id, prompt, resumed, sampling, observer,
                                        cache_salt)
            else:
                flow = self._disaggregated(decode, prefill, request_id, prompt, sampling,
                                           len(prompt) - route.cached_tokens, observer,
                                           cache_salt)
            async with aclosing(flow) as events:
                async for event in events:
                    yield event
        finally:
            decode.outstanding -= 1

    async def _aggregated(self, decode, request_id, prompt, resumed, sampling,
                          observer: AttemptObserver, cache_salt: str) -> AsyncIterator[TokenEvent]:
        """The decode (or role-both) worker runs the prompt (and resumed tokens) itself."""
        if resumed and sampling.HasField("prompt_logprobs"):
            # The client has them from the first attempt; the worker would score them again.
            sampling = common_pb2.SamplingParams.FromString(sampling.SerializeToString())
            sampling.ClearField("prompt_logprobs")
        call = decode.decode.Generate(decode_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
            remote_prefill=False, cache_salt=cache_salt, resumed_output_token_ids=resumed,
        ), metadata=observer.grpc_metadata)
        try:
            async with aclosing(decode_events(call, decode, resumed,
                                               resumed=bool(resumed))) as events:
                async for event in events:
                    yield event
        finally:
            call.cancel()

    async def _disaggregated(self, decode, prefill, request_id, prompt, sampling,
                             uncached_tokens: int, observer: AttemptObserver, cache_salt: str):
        call = decode.decode.Generate(decode_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
            remote_prefill=True, cache_salt=cache_salt, reuse_cached_prefix=True,
        ), metadata=observer.grpc_metadata)
        prefill_call = prefill_done = decode_next = None
        try:
            try:
                async with asyncio.timeout(self.prefill_timeout_s):
                    reserved = await read_message(call, decode)
            except TimeoutError:
                raise AttemptFailed(decode, synthetic_error(
                    "decode worker did not reserve KV blocks in time",
                    grpc.StatusCode.DEADLINE_EXCEEDED)) from None
            if reserved is None or not reserved.HasField("reserved"):
                raise AttemptFailed(decode, synthetic_error("decode stream did not reserve"))
            prefill_call = prefill.prefill.Prefill(prefill_pb2.PrefillRequest(
                request_id=request_id, prompt_token_ids=prompt, sampling=sampling,
                decode_kv_endpoint=reserved.reserved.kv_endpoint, cache_salt=cache_salt,
                # The decode worker's cached prefix: only the KV after it is sent.
                decode_cached_tokens=reserved.reserved.num_cached_tokens,
            ), timeout=self.prefill_timeout_s, metadata=observer.grpc_metadata)
            # Watch the decode stream while the prefill runs: a decode worker that dies now
            # fails the attempt before its first token, so it is retried, not errored.
            decode_next = asyncio.ensure_future(read_message(call, decode))
            prefill_done = asyncio.ensure_future(prefill_call)
            prefill.outstanding += 1
            prefill.prefill_tokens_in_flight += uncached_tokens
            try:
                await asyncio.wait({prefill_done, decode_next}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                prefill.outstanding -= 1
                prefill.prefill_tokens_in_flight -= uncached_tokens
            if decode_next.done():
                early = decode_next.result()  # an rpc error raises AttemptFailed here
                if early is None:
                    raise AttemptFailed(decode, synthetic_error("decode stream ended early"))
                if (not prefill_done.done() and early.HasField("delta")
                        and early.delta.output_index == 0):
                    # The decode worker recomputed the prompt and streams from the start on
                    # its own: the prefill is not needed any more.
                    prefill_call.cancel()
                    async with aclosing(decode_events(call, decode, (), decode_next)) as events:
                        async for event in events:
                            yield event
                    return
            try:
                response = await prefill_done
            except grpc.aio.AioRpcError as exc:
                raise AttemptFailed(prefill, exc) from None
            prefill.breaker.record_success()
            observer.prefilled(response.kv_bytes, response.num_cached_tokens)
            first = response.first_token
            yield TokenEvent(
                token_ids=(first.token_id,),
                logprobs=(convert.logprob_from_pb(first),) if sampling.HasField("logprobs") else (),
                prompt_logprobs=prompt_logprobs(response.prompt_logprobs),
                num_cached_tokens=response.num_cached_tokens,
                compute=convert.compute_from_pb(response.compute_seconds),
                # Said with the token, so its text can be left out (api/text_stream.py); the
                # decode worker's reservation is cancelled below.
                finish_reason="stop" if response.first_token_stops else None,
            )
            if response.first_token_stops:
                return
            async with aclosing(decode_events(call, decode, (first.token_id,),
                                               decode_next)) as events:
                async for event in events:
                    yield event
        finally:
            call.cancel()
            if prefill_call is not None:
                prefill_call.cancel()
            for task in (prefill_done, decode_next):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (prefill_done, decode_next) if t is not None),
                                 return_exceptions=True)


def _migration_reason(error: grpc.aio.AioRpcError) -> str:
    """Why a stream moves, as a bounded metric label."""
    details = error.details() or ""
    if "draining" in details:
        return "draining"
    if error.code() == grpc.StatusCode.UNAVAILABLE and "decode stream ended" in details:
        return "stream_ended"
    if error.code() == grpc.StatusCode.FAILED_PRECONDITION and "differ from" in details:
        return "diverged"
    return "worker_failed"
