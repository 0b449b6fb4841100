"""A request's time bounds: its deadline (--request-timeout-s, lowered by the caller with the
`x-request-timeout-s` header or a gRPC deadline) over every stage, and the inter-token stall
timeout (--stall-timeout-s) once a choice has its first token.

Before any output a breach is a 504 (DEADLINE_EXCEEDED over gRPC); after it, the choice ends
with a final delta whose finish_reason is "error". Either way the choice stream is closed,
which cancels its worker RPCs, so the workers free the request's KV wherever it was stuck.
A RequestDeadline belongs to the event-loop task serving its request.
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
T = TypeVar("T")


class RequestDeadline:
    def __init__(self, arrival: float, timeout_s: float | None, stall_s: float | None,
                 callers: bool = False) -> None:
        """`timeout_s`, `stall_s`: seconds, None for no limit; `callers`: the deadline is the
        caller's own (a gRPC deadline), not the server's limit."""
        self.timeout_s = timeout_s
        self.at = None if timeout_s is None else arrival + timeout_s
        self.stall_s = stall_s
        self.callers = callers

    @classmethod
    def for_http(cls, config, headers, arrival: float) -> RequestDeadline:
        """The server's limits, the deadline lowered by the caller's header (never raised)."""
        return cls(arrival, _lowest(_limit(config.request_timeout_s), _header(headers)),
                   _limit(config.stall_timeout_s))

    @classmethod
    def for_grpc(cls, config, context, arrival: float) -> RequestDeadline:
        """The server's limits, the deadline lowered by the call's own deadline."""
        remaining = context.time_remaining()
        caller = None if remaining is None else time.monotonic() - arrival + remaining
        server = _limit(config.request_timeout_s)
        return cls(arrival, _lowest(server, caller), _limit(config.stall_timeout_s),
                   callers=caller is not None and (server is None or caller <= server))

    def remaining(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def expired(self, stage: str) -> APIError:
        return APIError.timed_out(f"The request did not finish within its deadline of "
                                  f"{self.timeout_s:g}s ({stage}); it was aborted.")

    async def within(self, awaitable: Awaitable[T], stage: str) -> T:
        """`awaitable`, cancelled with a 504 when the deadline passes first."""
        scope = asyncio.timeout(self.remaining())
        try:
            async with scope:
                return await awaitable
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
                        delta = await anext(stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not scope.expired():
                        raise
                    if last is None:  # nothing sent for this choice: a status code is possible
                        raise self.expired("before the first token") from None
                    yield _failed(last, stalled, stall, self)
                    return
                last = delta
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            await stream.aclose()  # cancels the worker RPCs if they are still open


def _failed(last: TextDelta, stalled: bool, stall_s, deadline: RequestDeadline) -> TextDelta:
    if stalled:
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
