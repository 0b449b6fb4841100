"""The prefill worker's side of handing a request's KV to the decode worker that reserved
blocks for it, including the failure path: a transfer that fails after it was queued is
followed by an ABORT frame, so the decode worker recomputes the prompt at once instead of
waiting out --kv-wait-timeout-s.

Used on the gRPC event loop; kv_transfer completes transfers on its sender threads, and their
callbacks hop back to that loop before touching any sender (a failed sender calls back while
holding its own lock).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future

from kv_transfer import transfer_key

log = logging.getLogger(__name__)


class KVHandoff:
    """Wraps the worker's sender pool (a KVSenderPool or its tensor-parallel twin)."""

    def __init__(self, senders, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.senders = senders
        self._loop = loop
        self.num_failed = 0  # transfers that failed after queueing (event loop only)
        self.num_aborts_sent = 0  # ABORT frames that reached the decode worker

    def send(self, endpoint: str, request_id: str, first_token: int, num_tokens: int, kv,
             on_done: Callable[[BaseException | None], None] | None = None) -> Future:
        """Queue the transfer under the request's transfer key. Raises (as the sender pool
        does) when it cannot even be queued: the caller should fail the request, which also
        ends the decode side's wait. `on_done(error or None)` runs on the sender thread."""
        loop = self._loop or asyncio.get_running_loop()
        key = transfer_key(request_id)
        future = self.senders.send(endpoint, key, first_token, num_tokens, kv)

        def done(f: Future) -> None:  # sender thread
            error = _error_of(f)
            if error is not None:
                try:
                    loop.call_soon_threadsafe(self._failed, endpoint, request_id, error)
                except RuntimeError:
                    pass  # the event loop has closed: the worker is shutting down
            if on_done is not None:
                on_done(error)

        future.add_done_callback(done)
        return future

    def _failed(self, endpoint: str, request_id: str, error: BaseException) -> None:
        """Event loop. The channel that failed is gone; the pool opens a fresh one for the
        ABORT. If the decode worker cannot be reached at all, its channel error handling and
        its own bounds on waiting for KV are what is left."""
        self.num_failed += 1
        log.warning("KV transfer of %.80s to %s failed (%s); telling the decode worker to "
                    "recompute it", request_id, endpoint, error)
        try:
            abort = self.senders.send_abort(endpoint, transfer_key(request_id))
        except Exception as exc:
            log.warning("abort of %.80s not sent to %s: %s", request_id, endpoint, exc)
            return

        def sent(f: Future) -> None:  # sender thread; only counts and logs
            exc = _error_of(f)
            if exc is None:
                self.num_aborts_sent += 1
            else:
                log.warning("abort of %.80s to %s failed: %s", request_id, endpoint, exc)

        abort.add_done_callback(sent)


def _error_of(future: Future) -> BaseException | None:
    if future.cancelled():  # cancelled by a closing sender: the transfer never happened
        return RuntimeError("transfer cancelled (sender closing)")
    return future.exception()
