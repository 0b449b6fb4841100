"""Client connections, below the HTTP API: uvicorn's h11 protocol with the bounds an edge
server needs and uvicorn lacks.

- A request's headers must arrive within `read_timeout_s` of the connection opening (or of
  the first byte of the next request on a kept-alive connection), however they trickle in: a
  client that connects and sends nothing, or a byte now and then, is closed instead of
  holding a file descriptor for ever (slowloris). The body has its own bound
  (api/request_body.py).
- At most `max_connections` open at once: one more is closed as soon as it is accepted, so
  descriptors never run out under a flood of idle connections (the listener would fail every
  accept, real clients included, and log each failure).

- A connection closed while its client may still be sending a body the server did not read
  (a 413 on Content-Length, a 408) closes gently: see LingeringClose.
- A connection closed with output its client is not reading is reset once the client has
  taken nothing for `flush_timeout_s`: see LingeringClose.

An idle kept-alive connection is closed by uvicorn's own keep-alive timeout."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

# Descriptors kept for everything but client connections (worker channels, logs, Redis, files).
RESERVED_DESCRIPTORS = 256
# How long a connection closed on an unread body goes on reading (and dropping) it.
LINGER_S = 5.0


class LingeringClose:
    """A connection's transport whose close(), while the client may still be sending a body
    the server will not read, first half-closes (the response goes out, then a FIN), drops
    whatever the client still sends, and closes when the client does or after LINGER_S.
    Closed at once, a socket with unread data sends a reset, which can destroy the response
    before the client reads it: a client still uploading a body over --max-body-bytes got a
    connection reset instead of its 413 (6 of 6 in a soak test under load).

    A close with output still buffered waits for the client to take it, as asyncio's does,
    but only while the client takes some of it every `flush_timeout_s`; then the connection is
    reset. asyncio alone waited for ever: a client cut off for not reading (the slow-client
    timeout) kept its connection, its descriptor and megabytes of socket buffer, and got no
    end of stream, for as long as it stayed connected. Everything else is the transport's."""

    def __init__(self, transport, unread_body: Callable[[], bool], loop,
                 flush_timeout_s: float = 0.0) -> None:
        self._transport = transport
        self._unread_body = unread_body
        self._loop = loop
        self._flush_timeout_s = flush_timeout_s
        self.lingering = False
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        if not (self._unread_body() and self._transport.can_write_eof()):
            self._transport.close()
            self._watch_flush(self._transport.get_write_buffer_size())
            return
        try:
            self._transport.write_eof()  # after what is still buffered
        except OSError:
            # The client reset the connection first (it read its 408 or 413 and left): there
            # is nothing to linger for. Raised, it was two ERROR tracebacks per such client
            # (a robustness audit: 17 of them among 60 partial bodies).
            self._transport.abort()
            return
        self.lingering = True
        self._transport.resume_reading()
        self._timer = self._loop.call_later(LINGER_S, self._transport.close)

    def _watch_flush(self, buffered: int) -> None:
        """Resets the connection unless the client took some of `buffered` bytes within
        flush_timeout_s (0: waits as asyncio does)."""
        if buffered and self._flush_timeout_s > 0:
            self._timer = self._loop.call_later(self._flush_timeout_s, self._flushed, buffered)

    def _flushed(self, buffered: int) -> None:
        self._timer = None
        left = self._transport.get_write_buffer_size()
        if left and left >= buffered:
            self._transport.abort()  # nothing taken: a reset, and connection_lost follows
        else:
            self._watch_flush(left)

    def closed(self) -> None:
        """The connection is gone: nothing more to linger for."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._closing = True
        self._transport.close()


def raise_open_file_limit() -> int:
    """Lifts this process's soft limit on open files to its hard limit, as servers do; returns
    the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(open_file_limit: int) -> int:
    """What --max-connections 0 means: the open-file limit less a reserve of a tenth of it
    (at least RESERVED_DESCRIPTORS); never under 64."""
    return max(64, open_file_limit - max(RESERVED_DESCRIPTORS, open_file_limit // 10))


def connection_protocol(read_timeout_s: float, max_connections: int,
                        on_closed: Callable[[str], None],
                        flush_timeout_s: float = 0.0) -> type[H11Protocol]:
    """The protocol class to give uvicorn's `http`; `on_closed(reason)` counts the connections
    it closes ("limit", "header_timeout")."""

    class BoundedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _awaited_after = None  # the request cycle that was current when the header clock started

        def connection_made(self, transport) -> None:
            super().connection_made(LingeringClose(transport, self._unread_body,
                                                   asyncio.get_running_loop(), flush_timeout_s))
            if len(self.connections) > max_connections:
                on_closed("limit")
                transport.close()  # connection_lost follows and forgets it
                return
            self._start_header_clock()

        def _unread_body(self) -> bool:
            return self.cycle is not None and self.cycle.more_body

        def data_received(self, data: bytes) -> None:
            if self.transport.lingering:
                return  # the rest of a body it will not read
            if self._header_timer is None and (self.cycle is None or self.cycle.response_complete):
                self._start_header_clock()  # the first byte of the next request
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._awaited_after:
                self._stop_header_clock()  # its headers are in: a new request cycle began

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_clock()
            self.transport.closed()
            super().connection_lost(exc)

        def _start_header_clock(self) -> None:
            if read_timeout_s > 0:
                self._awaited_after = self.cycle
                self._header_timer = self.loop.call_later(read_timeout_s, self._header_timeout)

        def _stop_header_clock(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                on_closed("header_timeout")
                self.transport.close()

    return BoundedH11Protocol
