"""A request's time bounds: its deadline (--request-timeout-s, lowered by the caller with the
`x-request-timeout-s` header or a gRPC deadline) over every stage, the inter-token stall
timeout (--stall-timeout-s) once a choice has its first token, and the cutoff of a draining
gateway (StreamCutoff).

Before any output a breach is a 504 (DEADLINE_EXCEEDED over gRPC; the cutoff: 503, UNAVAILABLE,
to be retried elsewhere); after it, the choice ends with a final delta whose finish_reason is
"error". Either way the choice stream is closed, which cancels its worker RPCs, so the workers
free the request's KV wherever it was stuck. A RequestDeadline belongs to the event-loop task
serving its request.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from services.gateway.api.text_stream import TextDelta
from services.gateway.errors import APIError

TIMEOUT_HEADER = "x-request-timeout-s"
TIMEOUT_CODES = ("request_timeout", "stream_stalled")  # TextDelta.error_code of a breach
SHUTTING_DOWN = "server_shutting_down"  # TextDelta.error_code of a stream the cutoff ended
CUTOFF_MARGIN_S = 1.0  # how long before the end of a drain's grace the cutoff comes
_TIMER_SLACK_S = 0.001  # an event-loop timer may fire up to its clock's resolution early
T = TypeVar("T")


class StreamCutoff:
    """When a draining gateway ends the requests it still has open: CUTOFF_MARGIN_S before its
    grace runs out (at half the grace, if that is shorter), so that each ends as a failure
    does, a stream with its final error message and a request without output with a 503 that
    may be retried elsewhere. At the end of the grace the servers stop on their own, and cut
    what is left: gRPC with UNAVAILABLE "Cancelling all calls" after output (a status a retry
    policy replays, delivered text and all), an HTTP stream without its last event.
    Owned by the event loop."""

    def __init__(self) -> None:
        self.at: float | None = None  # time.monotonic() of the cutoff; None: not draining
        self._waits: set[asyncio.Timeout] = set()  # the bounded waits under way

    def drain(self, grace_s: float) -> None:
        """The drain began: cut at the end of its grace, less the margin, the waits under way
        as well as those to come. A second signal changes nothing."""
        if self.at is not None:
            return
        self.at = time.monotonic() + max(grace_s - CUTOFF_MARGIN_S, grace_s / 2)
        when = asyncio.get_running_loop().time() + (self.at - time.monotonic())
        for wait in self._waits:
            if wait.when() is None or wait.when() > when:
                wait.reschedule(when)

    async def bounded(self, scope: asyncio.Timeout, awaitable: Awaitable[T]) -> T:
        """`awaitable` in an entered `scope`, which a drain beginning meanwhile reschedules."""
        self._waits.add(scope)
        try:
            return await awaitable
        finally:
            self._waits.discard(scope)

    def passed(self, deadline_at: float | None) -> bool:
        """Whether a timed-out wait was cut by the cutoff rather than a deadline at
        `deadline_at` (monotonic; None: none)."""
        return (self.at is not None and time.monotonic() >= self.at - _TIMER_SLACK_S
                and (deadline_at is None or self.at < deadline_at))


class RequestDeadline:
    def __init__(self, arrival: float, timeout_s: float | None, stall_s: float | None,
                 callers: bool = False, cutoff: StreamCutoff | None = None) -> None:
        """`timeout_s`, `stall_s`: seconds, None for no limit; `callers`: the deadline is the
        caller's own (a gRPC deadline), not the server's limit; `cutoff`: the gateway's."""
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else arrival + timeout_s
        self.stall_s = stall_s
        self.callers = callers
        self.cutoff = cutoff or StreamCutoff()

    @classmethod
    def for_http(cls, config, headers, arrival: float,
                 cutoff: StreamCutoff | None = None) -> RequestDeadline:
        """The server's limits, the deadline lowered by the caller's header (never raised)."""
        return cls(arrival, _lowest(_limit(config.request_timeout_s), _header(headers)),
                   _limit(config.stall_timeout_s), cutoff=cutoff)

    @classmethod
    def for_grpc(cls, config, context, arrival: float,
                 cutoff: StreamCutoff | None = None) -> RequestDeadline:
        """The server's limits, the deadline lowered by the call's own deadline."""
        remaining = context.time_remaining()
        caller = None if remaining is None else time.monotonic() - arrival + remaining
        server = _limit(config.request_timeout_s)
        return cls(arrival, _lowest(server, caller), _limit(config.stall_timeout_s),
                   callers=caller is not None and (server is None or caller <= server),
                   cutoff=cutoff)

    def remaining(self) -> float | None:
        """Seconds to the deadline or the cutoff, whichever is first (None: neither)."""
        ends = [at for at in (self.at, self.cutoff.at) if at is not None]
        return max(0.0, min(ends) - time.monotonic()) if ends else None

    def expired(self, stage: str) -> APIError:
        if self.cutoff.passed(self.at):
            return APIError.shutting_down()
        return APIError.timed_out(f"The request did not finish within its deadline of "
                                  f"{self.timeout_s:g}s ({stage}); it was aborted.")

    async def within(self, awaitable: Awaitable[T], stage: str) -> T:
        """`awaitable`, cancelled with a 504 when the deadline passes first (a 503 when the
        cutoff does)."""
        scope = asyncio.timeout(self.remaining())
        try:
            async with scope:
                return await self.cutoff.bounded(scope, awaitable)
        except TimeoutError:
            if scope.expired():
                raise self.expired(stage) from None
            raise

    async def bound(self, stream: AsyncIterator[TextDelta]) -> AsyncIterator[TextDelta]:
        """`stream` under the deadline and, from its first token on, the stall timeout. Only
        the wait for the next delta is timed: a consumer that is slow to read (backpressure)
        is the slow-client timeout's business, not a stall."""
        last: TextDelta | None = None
        try:
            while True:
                remaining = self.remaining()
                stall = self.stall_s if last is not None and last.num_output_tokens else None
                stalled = stall is not None and (remaining is None or stall < remaining)
                budget = stall if stalled else remaining
                scope = asyncio.timeout(budget)
                try:
                    async with scope:
                        delta = await self.cutoff.bounded(scope, anext(stream))
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not scope.expired():
                        raise
                    if last is None:  # nothing sent for this choice: a status code is possible
                        raise self.expired("before the first token") from None
                    cut = self.cutoff.passed(self.at)
                    yield _failed(last, stalled and not cut, stall, self, cut)
                    return
                last = delta
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            await stream.aclose()  # cancels the worker RPCs if they are still open


def _failed(last: TextDelta, stalled: bool, stall_s, deadline: RequestDeadline,
            cut: bool) -> TextDelta:
    if cut:
        error, code = "the server is shutting down; the request was aborted", SHUTTING_DOWN
    elif stalled:
        error, code = (f"no token for {stall_s:g}s (--stall-timeout-s); the request was "
                       "aborted"), "stream_stalled"
    else:
        error, code = (f"the request did not finish within its deadline of "
                       f"{deadline.timeout_s:g}s; it was aborted"), "request_timeout"
    return TextDelta(index=last.index, text="", token_ids=(), logprobs=(),
                     num_output_tokens=last.num_output_tokens, finish_reason="error",
                     error=error, error_code=code, num_cached_tokens=last.num_cached_tokens,
                     compute=last.compute)


def _limit(seconds: float) -> float | None:
    return seconds if seconds > 0 else None


def _lowest(*limits: float | None) -> float | None:
    return min((x for x in limits if x is not None), default=None)


def _header(headers) -> float | None:
    raw = headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise APIError.invalid(f"The {TIMEOUT_HEADER} header must be a positive number of "
                               f"seconds, got {raw!r}.", param=TIMEOUT_HEADER,
                               code="invalid_timeout")
    return value
