"""KVSender: the prefill worker's end of one channel; a queue and one thread define the frame order."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kv_transfer import auth
from kv_transfer.channel import (
    KVChannel,
    KVChannelError,
    channel_key,
    parse_endpoint,
    timedelta,
)
from kv_transfer.header import HeaderFlag, KVHeader, encode_header, header_to_bytes
from kv_transfer.layout import KVLayout, LayoutMismatchError
from kv_transfer.sender_handshake import open_channel
from kv_transfer.shared_memory import DEFAULT_SHARED_MEMORY_BYTES, region_bytes_ok
from kv_transfer.stats import KVStats

logger = logging.getLogger(__name__)
_instance_ids = itertools.count()


@dataclass(frozen=True)
class TransferResult:
    """How one transfer went, as seen by the sender."""

    nbytes: int  # payload bytes (0 for an abort)
    seconds: float  # doorbell + payload on the wire, until the receiver had all of it
    queued_seconds: float  # time spent waiting in the sender queue before that


class KVQueueFullError(RuntimeError):
    """send() refused: max_queued transfers are already waiting on this channel."""


@dataclass
class _Item:
    request_key: str
    first_token: int
    num_tokens: int
    num_blocks: int
    flags: HeaderFlag
    payload: torch.Tensor | None
    future: Future
    enqueued: float
    ready_event: object | None  # torch.cuda.Event recorded on the caller's stream (CUDA only)


_CLOSE = object()  # queue sentinel: send CLOSE after everything queued before it


class KVSender:
    """Sends KV payloads to one KVReceiver endpoint, in send() order, from one thread.

    Threads: the constructor returns at once; the channel thread connects (store, hello,
    verdict, process group), then drains the queue. It alone owns the store client, the group
    and the frame sequence number. send()/send_abort()/close() are thread-safe and never block
    on the network: the prefill engine loop calls them. On any channel error the sender becomes
    broken for good: queued futures fail with that error and later sends raise it; build a new
    KVSender (KVSenderPool does) to reconnect.

    Backpressure: at most `max_queued` transfers wait; send() then raises KVQueueFullError at
    once rather than blocking the engine loop, so the caller chooses (retry later, or let decode
    recompute). The queue holds a reference to each kv tensor: do not modify it before its
    future completes.
    """

    def __init__(
        self,
        endpoint: str,
        layout: KVLayout,
        device: str | torch.device = "cpu",
        timeout_s: float = 10.0,
        *,
        peer_id: str | None = None,
        max_queued: int = 64,
        stats: KVStats | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        secret: bytes | None = None,
        shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES,
    ):
        self.host, self.port = parse_endpoint(endpoint)
        # Offered to the receiver on CPU; used when it can map it (same host), else gloo. 0: never.
        if shared_memory_bytes > 0 and (reason := region_bytes_ok(shared_memory_bytes)):
            raise ValueError(reason)
        self.shared_memory_bytes = shared_memory_bytes
        self.secret = secret or None  # with it, both ends prove it before the group is built
        self.tp_rank = tp_rank  # told to the receiver, which refuses another degree or rank
        self.tp_size = tp_size
        self.endpoint = endpoint
        self.layout = layout
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.peer_id = peer_id or f"{socket.gethostname()}:{os.getpid()}/{next(_instance_ids)}"
        self.stats = stats if stats is not None else KVStats()
        self._lock = threading.Lock()  # guards _error, _closing and enqueueing
        self._queue: queue.Queue = queue.Queue()  # bounded by send(), so close() can always enqueue
        self._error: BaseException | None = None
        self._closing = False
        self._settled = threading.Event()  # set once connected, or once connecting failed
        # Owned by the channel thread:
        self._store: dist.Store | None = None
        self._channel: KVChannel | None = None
        self._index = -1
        self._seq = 0
        self._heartbeat_s = timeout_s / 4
        self._frame_key: bytes | None = None
        self._thread = threading.Thread(target=self._run, name=f"kv-send-{endpoint}", daemon=True)
        self._thread.start()

    # ---- public ---------------------------------------------------------------------------

    def send(self, request_key: str, first_token: int, num_tokens: int, kv: torch.Tensor) -> Future:
        """Queue `kv` ([num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]) for the
        receiver. Returns a Future[TransferResult]. Raises ValueError for a payload that does not
        match the layout, KVQueueFullError when the queue is full, KVChannelError (or the
        connect error) when the sender is broken or closed."""
        num_blocks = self.layout.check_tensor(kv)
        if kv.device != self.device and not (
            kv.device.type == self.device.type == "cuda" and self.device.index is None
        ):
            raise ValueError(f"KV payload is on {kv.device}, this sender sends from {self.device}")
        # Encode once now so a bad key or token count fails here, on the caller's stack.
        encode_header(KVHeader(request_key, num_tokens, num_blocks, first_token, self.layout))
        ready_event = None
        if kv.is_cuda:
            ready_event = torch.cuda.Event()
            ready_event.record(torch.cuda.current_stream(kv.device))
        return self._enqueue(
            _Item(
                request_key,
                first_token,
                num_tokens,
                num_blocks,
                HeaderFlag.DATA,
                kv,
                Future(),
                time.perf_counter(),
                ready_event,
            )
        )

    def send_abort(self, request_key: str) -> Future:
        """Tell the receiver that this request's KV will not come (frees its blocks sooner)."""
        encode_header(KVHeader(request_key, 0, 0, -1, self.layout, HeaderFlag.ABORT))
        return self._enqueue(
            _Item(
                request_key, -1, 0, 0, HeaderFlag.ABORT, None, Future(), time.perf_counter(), None
            )
        )

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until connected; raise the connect error (e.g. LayoutMismatchError) if any."""
        if not self._settled.wait(self.timeout_s * 3 if timeout_s is None else timeout_s):
            raise TimeoutError(f"KV sender to {self.endpoint} not connected yet")
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> BaseException | None:
        """Why this sender is broken, or None while it is usable."""
        return self._error

    @property
    def transport(self) -> str | None:
        """How payloads travel once connected ("shared memory", "gloo", "nccl"); None before."""
        channel = self._channel
        return channel.transport if channel is not None else None

    @property
    def usable(self) -> bool:
        return self._error is None and not self._closing

    def close(self, cancel_pending: bool = False, timeout_s: float | None = None) -> None:
        """Send what is queued (or cancel it), tell the receiver, and stop. Idempotent."""
        with self._lock:
            if not self._closing:
                self._closing = True
                if cancel_pending:
                    self._drain(lambda item: item.future.cancel())
                self._queue.put(_CLOSE)
        if threading.current_thread() is not self._thread:
            self._thread.join(self.timeout_s + 1.0 if timeout_s is None else timeout_s)

    def __enter__(self) -> KVSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- caller side helpers --------------------------------------------------------------

    def _enqueue(self, item: _Item) -> Future:
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._closing:
                raise KVChannelError(
                    f"KV sender to {self.endpoint} is closed", peer_id=self.peer_id
                )
            if self._queue.qsize() >= self.max_queued:
                self.stats.add(rejected=1)
                raise KVQueueFullError(
                    f"{self.max_queued} KV transfers already queued for {self.endpoint}"
                )
            self._queue.put(item)
        return item.future

    def _drain(self, settle) -> int:
        """Empty the queue (caller holds _lock), applying `settle` to each transfer."""
        count = 0
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return count
            if item is not _CLOSE:
                settle(item)
                count += 1

    # ---- channel thread -------------------------------------------------------------------

    def _run(self) -> None:
        current: _Item | None = None  # the transfer in flight, failed with the channel
        try:
            self._connect()
            self._settled.set()
            while True:
                try:
                    item = self._queue.get(timeout=self._heartbeat_s)
                except queue.Empty:
                    self._heartbeat()
                    continue
                if item is _CLOSE:
                    self._push(KVHeader("", 0, 0, -1, self.layout, HeaderFlag.CLOSE))
                    return
                if item.future.set_running_or_notify_cancel():
                    current = item
                    self._transfer(item)
                    current = None
        except Exception as exc:
            if not isinstance(exc, (KVChannelError, LayoutMismatchError)):
                wrapped = KVChannelError(
                    f"KV sender to {self.endpoint} failed: {exc}", peer_id=self.peer_id
                )
                wrapped.__cause__ = exc
                exc = wrapped
            if current is not None and isinstance(exc, KVChannelError):
                exc.request_key = current.request_key
            self._fail(exc, current)
        finally:
            self._settled.set()
            if self._channel is not None:
                self._channel.close()
                self.stats.add(channels_closed=1)
            self._channel = self._store = None

    def _connect(self) -> None:
        # TCPStore retries the connection until timeout_s, which covers a receiver that is
        # still starting up.
        store = dist.TCPStore(
            self.host, self.port, is_master=False, timeout=timedelta(self.timeout_s)
        )
        self._store = store
        opened = open_channel(self, store)
        self._index, self._channel = opened.index, opened.channel
        self._heartbeat_s, self._frame_key = opened.heartbeat_s, opened.frame_key
        self.stats.add(channels_opened=1)
        logger.info("kv sender %s: channel %d to %s (%s)", self.peer_id, self._index,
                    self.endpoint, self._channel.transport)

    def _push(self, header: KVHeader) -> None:
        """Ring the doorbell with the next frame's header (the receiver pops it from the store)."""
        frame = header_to_bytes(dataclasses.replace(header, seq=self._seq))
        if self._frame_key is not None:
            frame = auth.tag_frame(self._frame_key, frame)
        self._store.queue_push(channel_key(self._index, "bell"), frame)
        self._seq += 1

    def _heartbeat(self) -> None:
        self._push(KVHeader("", 0, 0, -1, self.layout, HeaderFlag.HEARTBEAT))
        # An idle channel has no other way to learn that the receiver dropped it.
        if self._store.check([channel_key(self._index, "closed")]):
            raise KVChannelError(
                f"KV receiver {self.endpoint} closed this channel", peer_id=self.peer_id
            )

    def _transfer(self, item: _Item) -> None:
        start = time.perf_counter()
        if item.ready_event is not None:
            torch.cuda.current_stream(self.device).wait_event(item.ready_event)
        self._push(
            KVHeader(
                item.request_key,
                item.num_tokens,
                item.num_blocks,
                item.first_token,
                self.layout,
                item.flags,
            )
        )
        if item.payload is not None:
            self._channel.send(item.payload)
        seconds = time.perf_counter() - start
        nbytes = item.payload.nbytes if item.payload is not None else 0
        if item.flags & HeaderFlag.ABORT:
            self.stats.add(aborts=1)
        else:
            shared = nbytes if self._channel.uses_region(item.payload) else 0
            self.stats.add(transfers=1, bytes=nbytes, shared_bytes=shared, seconds=seconds)
        item.future.set_result(TransferResult(nbytes, seconds, start - item.enqueued))

    def _fail(self, exc: BaseException, current: _Item | None = None) -> None:
        # Mark broken before any future fails: whoever sees a failed future and sends again
        # (e.g. KVSenderPool) must already find this sender unusable.
        with self._lock:
            if self._error is None:
                self._error = exc
            failed = self._drain(lambda item: _settle_exception(item.future, exc))
        if current is not None:
            _settle_exception(current.future, exc)
            failed += 1
        if not self._closing or failed:
            self.stats.add(failures=1, failed_transfers=failed)
            logger.warning("kv sender %s -> %s failed: %s", self.peer_id, self.endpoint, exc)


def _settle_exception(future: Future, exc: BaseException) -> None:
    try:
        future.set_exception(exc)
    except InvalidStateError:
        pass  # cancelled meanwhile by its owner
