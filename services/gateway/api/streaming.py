"""Server-Sent Events for one HTTP request: choice streams merged through a bounded buffer,
written with a per-write timeout (a client that stops reading is cut off and its request
aborted) while the connection is watched for a disconnect (which aborts it too).

Everything here runs on the gateway's event loop; each response owns its tasks and closes
every choice stream it opened, which cancels the worker RPCs still open.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.responses import Response

from engine.outputs import ComputeSeconds
from services.gateway.api.responses import BodyFormat, usage
from services.gateway.api.text_stream import TextDelta
from services.gateway.errors import APIError

log = logging.getLogger(__name__)
# Set in the request's task when SSEResponse cuts a client off without ending the response:
# uvicorn then logs "ASGI callable returned without completing response" at ERROR for what
# is a deliberate, already logged cut (cut_off_filter drops that one line).
_CUT_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("sse_cut_off", default=False)
UNFINISHED_RESPONSE = "ASGI callable returned without completing response."


def cut_off_filter(record: logging.LogRecord) -> bool:
    """A filter for uvicorn's error logger: False (drop) for its unfinished-response line
    where this request's task cut its slow client off on purpose."""
    return not (_CUT_OFF.get() and record.getMessage() == UNFINISHED_RESPONSE)

ChoiceStream = AsyncIterator[TextDelta]
_END = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was sent."""


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive, awaitable: Awaitable[Any]) -> Any:
    """Await `awaitable`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def open_streams(streams: list[ChoiceStream]) -> list[TextDelta]:
    """First delta of every choice: proof that each request reached a worker and produced a
    token. A failure (an APIError) or a cancel closes every stream, so that no worker request
    outlives it and a status code can still be sent."""
    try:
        firsts = await asyncio.gather(*(anext(s) for s in streams), return_exceptions=True)
        failure = next((r for r in firsts if isinstance(r, BaseException)), None)
        if isinstance(failure, StopAsyncIteration):
            failure = APIError.internal("a worker stream ended without output")
        if failure is not None:
            raise failure
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise
    return firsts


async def sse_events(
    streams: list[ChoiceStream], firsts: list[TextDelta], fmt: BodyFormat,
    prompt_tokens: int, buffer_size: int,
) -> AsyncIterator[bytes]:
    """The SSE byte chunks of a whole response; closing it aborts every open choice."""
    buffer: asyncio.Queue = asyncio.Queue(maxsize=buffer_size)

    async def pump(first: TextDelta, stream: ChoiceStream) -> None:
        last = first
        try:
            await buffer.put(first)
            async for delta in stream:
                last = delta
                await buffer.put(delta)
        except Exception as exc:  # a failed choice still ends, visibly, its tokens counted
            log.exception("choice stream %d failed", first.index)
            await buffer.put(dataclasses.replace(
                last, text="", token_ids=(), logprobs=(), prompt_logprobs=None,
                finish_reason="error", error=str(exc), error_code=None, stop_reason=None))
        finally:
            await stream.aclose()
        await buffer.put(_END)  # not when cancelled: nobody would read it

    pumps = [asyncio.create_task(pump(f, s)) for f, s in zip(firsts, streams, strict=True)]
    latest: dict[int, TextDelta] = {}  # each choice's last delta (usage so far, open choices)
    completion_tokens = cached_tokens = 0
    compute = ComputeSeconds()
    try:
        for event in fmt.opening([first.index for first in firsts],
                                 _usage_so_far(prompt_tokens, ()) if fmt.continuous_usage
                                 else None):
            yield event
        remaining = len(pumps)
        while remaining:
            item = await buffer.get()
            if item is _END:
                remaining -= 1
                continue
            chunks = fmt.chunks(item)
            latest[item.index] = item
            if fmt.continuous_usage:
                for chunk in chunks:
                    chunk["usage"] = _usage_so_far(prompt_tokens, latest.values())
            for chunk in chunks:
                yield fmt.encode(chunk)
            if item.finish_reason is not None:
                completion_tokens += item.num_output_tokens
                cached_tokens = max(cached_tokens, item.num_cached_tokens)
                compute = compute + item.compute
            if item.finish_reason == "error":
                # Tokens were already sent: no silent retry, an explicit error event instead.
                error = (APIError.invalid(item.error, code=item.error_code)
                         if item.error_code == "invalid_structured_output" else
                         APIError(500, item.error or "a worker failed mid-stream",
                                  "server_error", code=item.error_code or "worker_failed"))
                # The response ends here: the other choices still open end too, each with
                # its finish_reason, and the tokens they were sent count in the usage (an
                # n=2 stream left one choice unfinished and counted 79 of 172 tokens).
                # (A choice none of whose deltas was read yet ends too, having sent nothing.)
                for index in (f.index for f in firsts if f.index not in latest):
                    latest[index] = TextDelta(index=index, text="", token_ids=(),
                                              logprobs=(), num_output_tokens=0)
                for other in latest.values():
                    if other.finish_reason is None:
                        completion_tokens += other.num_output_tokens
                        for chunk in fmt.chunks(dataclasses.replace(
                                other, text="", token_ids=(), logprobs=(),
                                finish_reason="error", error=item.error,
                                error_code=item.error_code, prompt_logprobs=None)):
                            yield fmt.encode(chunk)
                yield fmt.error_event(error)
                break
        for event in fmt.closing(usage(prompt_tokens, completion_tokens, cached_tokens, compute)):
            yield event
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _usage_so_far(prompt_tokens: int, deltas) -> dict:
    deltas = list(deltas)
    return usage(prompt_tokens, sum(d.num_output_tokens for d in deltas),
                 max((d.num_cached_tokens for d in deltas), default=0),
                 sum((d.compute for d in deltas), ComputeSeconds()))


class SSEResponse(Response):
    """An ASGI response that writes `events` and gives up on a client that does not read.
    `on_close` learns how it ended: "complete", "client_disconnected", "slow_client" or
    "failed"."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], write_timeout_s: float,
                 headers: dict[str, str] | None = None,
                 on_close: Callable[[str], Awaitable[None]] | None = None) -> None:
        # Not Response.__init__: there is no body to render; __call__ streams instead.
        self.status_code = 200
        self.background = None
        self.raw_headers = []
        self.events = events
        self.write_timeout_s = write_timeout_s
        self.extra_headers = headers or {}
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                   (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        headers += [(k.lower().encode(), v.encode()) for k, v in self.extra_headers.items()]
        writer = asyncio.ensure_future(self._write(send, headers))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        done: set = set()
        ended = "failed"
        try:
            done, _ = await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            await asyncio.gather(writer, watcher, return_exceptions=True)
            await self.events.aclose()
            if writer not in done:
                ended = "client_disconnected" if done else "failed"
            elif not writer.cancelled() and writer.exception() is None:
                ended = "complete" if writer.result() else "slow_client"
            if self.on_close is not None:  # also when `events` never started
                await self.on_close(ended)
        if ended == "slow_client":
            _CUT_OFF.set(True)
        if ended == "client_disconnected":
            log.info("client disconnected mid-stream; request aborted")
        elif not writer.cancelled() and writer.exception() is not None:
            log.error("stream failed", exc_info=writer.exception())

    async def _write(self, send, headers) -> bool:
        """False when the client was cut off for not reading."""
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        async for chunk in self.events:
            message = {"type": "http.response.body", "body": chunk, "more_body": True}
            try:
                # Not asyncio.wait_for: before Python 3.12 it can swallow this task's
                # cancellation when the send completes at the same moment (as sends to a
                # disconnected client do, instantly), and the stream would run on.
                async with asyncio.timeout(self.write_timeout_s):
                    await send(message)
            except TimeoutError:
                log.warning("client read nothing for %.1fs; cutting it off and aborting the "
                            "request", self.write_timeout_s)
                return False
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True
