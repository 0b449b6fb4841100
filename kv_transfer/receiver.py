"""KVReceiver: the decode worker's end; hosts the rendezvous store and reads one channel per sender.

Senders may arrive, die and come back at any time; each gets its own channel and thread. With a
cluster secret, a sender proves it before its channel moves any tensor (kv_transfer.auth).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from kv_transfer import auth
from kv_transfer.buffer_pool import KVBufferPool
from kv_transfer.channel import (
    ARRIVALS_QUEUE,
    PEERS_COUNTER,
    KVChannelError,
    backend_name,
    channel_key,
    tensor_parallel_mismatch,
    timedelta,
)
from kv_transfer.frame_check import FrameRefused, check_hello
from kv_transfer.header import KVHeader
from kv_transfer.inbound_channel import WAKE, InboundChannel
from kv_transfer.layout import KVLayout, LayoutMismatchError
from kv_transfer.shared_memory import SharedRegion
from kv_transfer.stats import KVStats
from kv_transfer.store import bound_store

logger = logging.getLogger(__name__)

# The accept thread blocks on the arrivals queue; close() wakes it, so this only bounds how
# often an idle receiver logs c10d's socket-timeout warning.
_ACCEPT_POLL_S = 24 * 3600.0
# A decode worker has a channel per prefill worker rank; far more means someone is opening
# channels to exhaust threads.
DEFAULT_MAX_CHANNELS = 256
# A hello is a few hundred bytes of JSON; anything much larger is not one.
MAX_HELLO_BYTES = 4096
# Connecting a channel's store client to the master: tries before the hello is refused.
_CLONE_ATTEMPTS = 3

OnKV = Callable[[KVHeader, torch.Tensor], None]
_warned_no_secret = threading.Event()


class KVReceiver:
    """Accepts KV from any number of prefill senders and hands each payload to `on_kv`.

    Threads: an accept thread pops hello messages from the store; each accepted sender gets a
    channel thread that owns that channel's store client and process group and calls the
    callbacks. Callbacks therefore run on channel threads, concurrently across channels, and a
    slow `on_kv` stalls its channel (the sender's wait counts it against timeout_s): hand the
    payload to your own queue. `on_kv` owns the payload; call `release(payload)` when done
    with it to recycle the buffer (optional, but a fresh buffer per transfer halves gloo
    throughput). Public methods are thread-safe.

    Doorbell: a channel thread waits for the next frame by popping the channel's `bell` queue
    in the store, not by posting a recv on the group. gloo cannot wait indefinitely: a timed-out
    recv poisons the pair. The store can, so idle channels wait there (the sender's heartbeat
    every timeout_s/4 proves it is alive), and a group op is posted only when the header says a
    payload is coming, with a real timeout_s deadline.

    Every frame is checked before anything is allocated for it (kv_transfer.frame_check, then
    `check_frame(header)`, the caller's own rules, returning a reason to refuse or None). A
    refused DATA frame fails only its request (`on_refused(header, reason)`): its payload is
    read and discarded when it is no larger than `max_blocks` blocks, which keeps the channel in
    step; a frame the channel cannot stay in step with (torn header, oversized payload) closes
    the channel instead. With `secret`, senders must prove it (a mutual HMAC challenge) before
    their channel is built, and every frame carries a tag under a per-channel key; a forged
    frame is dropped and counted, the channel stays up.
    """

    def __init__(
        self,
        host: str,
        port: int,
        layout: KVLayout,
        device: str | torch.device,
        on_kv: OnKV,
        timeout_s: float = 10.0,
        *,
        is_wanted: Callable[[str], bool] | None = None,
        on_abort: Callable[[KVHeader], None] | None = None,
        on_channel_error: Callable[[str, BaseException], None] | None = None,
        buffer_pool: KVBufferPool | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        secret: bytes | None = None,
        max_blocks: int | None = None,
        check_frame: Callable[[KVHeader], str | None] | None = None,
        on_refused: Callable[[KVHeader, str], None] | None = None,
        max_channels: int = DEFAULT_MAX_CHANNELS,
        shared_memory: bool = True,
    ):
        self.layout = layout
        # Map a region a sender on this host offers (CPU only); False keeps every payload on gloo.
        self.shared_memory = shared_memory
        self.secret = secret or None
        self.max_blocks = max_blocks
        self.max_channels = max_channels
        self._check_frame = check_frame
        self._on_refused = on_refused
        # Rank tp_rank of a TP-tp_size decode worker takes KV from the same rank of prefill.
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.stats = KVStats()
        self._on_kv = on_kv
        self._is_wanted = is_wanted
        self._on_abort = on_abort
        self._on_channel_error = on_channel_error
        self._pool = buffer_pool if buffer_pool is not None else KVBufferPool(self.device)
        self._lock = threading.Lock()  # guards _channels and _closed
        self._channels: dict[int, InboundChannel] = {}
        self._closed = False
        # Only __init__ and close() touch the master store object; threads use clones.
        self._store = bound_store(host, port, timedelta(timeout_s))
        self.endpoint = f"{host}:{self._store.port}"
        if self.secret is None and not _warned_no_secret.is_set():
            _warned_no_secret.set()
            logger.warning(
                "kv receiver %s: no cluster secret configured; any peer that reaches this port "
                "can open a KV channel (set --cluster-secret-file)", self.endpoint
            )
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-recv-accept-{self._store.port}", daemon=True
        )
        self._accept_thread.start()

    # ---- public ---------------------------------------------------------------------------

    def release(self, payload: torch.Tensor) -> None:
        """Give a payload from on_kv back for reuse; the caller must not read it afterwards."""
        self._pool.release(payload)

    def peers(self) -> list[str]:
        """peer_ids of the senders with a live channel."""
        with self._lock:
            return [ch.peer_id for ch in self._channels.values()]

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting, end every channel and stop hosting the store. Idempotent.

        A channel in the middle of a payload finishes it (bounded by timeout_s) first.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            channels = list(self._channels.values())
        for ch in channels:
            ch.stopping = True
        try:
            self._store.queue_push(ARRIVALS_QUEUE, WAKE)
            for ch in channels:
                self._store.queue_push(channel_key(ch.index, "bell"), WAKE)
        except RuntimeError:
            logger.debug("could not wake kv threads", exc_info=True)
        join_s = self.timeout_s + 1.0 if timeout_s is None else timeout_s
        self._accept_thread.join(join_s)
        for ch in channels:
            if ch.thread is not threading.current_thread():  # close() called from a callback
                ch.thread.join(join_s)
        # Dropping the master object stops the store server; senders notice on their next op.
        self._store = None

    def __enter__(self) -> KVReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- accept thread --------------------------------------------------------------------

    def _accept_loop(self) -> None:
        store = self._store.clone()
        store.set_timeout(timedelta(_ACCEPT_POLL_S))
        while not self._closed:
            try:
                raw = store.queue_pop(ARRIVALS_QUEUE, True)
            except RuntimeError:
                if self._closed:
                    return
                continue  # poll timeout on a long-idle receiver
            if raw == WAKE or self._closed:
                continue
            try:
                hello = check_hello(raw, MAX_HELLO_BYTES, store.add(PEERS_COUNTER, 0))
            except FrameRefused as exc:
                self.stats.add(refused=1)
                logger.warning("kv receiver %s: ignored a hello: %s", self.endpoint, exc)
                continue
            try:
                self._admit(store, hello)
            except Exception as exc:  # a store hiccup must not kill the accept loop
                logger.exception("kv receiver %s: bad hello %r", self.endpoint, raw[:200])
                self._refuse_quietly(store, hello, exc)

    def _admit(self, store: dist.Store, hello: dict) -> None:
        index, peer_id = hello["index"], hello["peer_id"]
        verdict_key = channel_key(index, "verdict")
        with self._lock:
            in_use, num_channels = index in self._channels, len(self._channels)
        if in_use:
            # Another hello already took this index: answering would overwrite its verdict.
            self.stats.add(refused=1)
            logger.warning("kv receiver %s: second hello for channel %d (%s) ignored",
                           self.endpoint, index, peer_id)
            return
        try:
            if num_channels >= self.max_channels:
                raise KVChannelError(
                    f"decode worker has {num_channels} KV channels open, its limit", peer_id=peer_id
                )
            sender_nonce = hello.get("nonce")
            if self.secret is not None and not auth.is_nonce(sender_nonce):
                self.stats.add(auth_failures=1)
                raise KVChannelError(
                    "this KV receiver requires the cluster secret; start the prefill worker "
                    "with the same --cluster-secret-file", peer_id=peer_id
                )
            try:
                peer_layout = KVLayout.from_dict(hello["layout"])
            except (TypeError, ValueError) as exc:
                raise LayoutMismatchError(f"prefill sent an unusable KV layout: {exc}") from exc
            peer_tp = int(hello.get("tp_size", 1)), int(hello.get("tp_rank", 0))
            if peer_tp[0] != self.tp_size:
                raise LayoutMismatchError(tensor_parallel_mismatch(self.tp_size, peer_tp[0]))
            if peer_tp[1] != self.tp_rank:
                raise LayoutMismatchError(
                    f"prefill rank {peer_tp[1]} reached the KV endpoint of decode rank "
                    f"{self.tp_rank}; endpoints must be used in rank order"
                )
            self.layout.check_compatible(peer_layout, self_name="decode", other_name="prefill")
            if hello.get("backend") != backend_name(self.device):
                raise KVChannelError(
                    f"backend mismatch: decode uses {backend_name(self.device)} on "
                    f"{self.device}, prefill {hello.get('backend')}",
                    peer_id=peer_id,
                )
        except (LayoutMismatchError, KVChannelError) as exc:
            # Not on_channel_error: a refused channel never carried a transfer, so nothing
            # waiting for KV is affected. Counted before the sender hears the verdict, so the
            # count already shows the refusal once the sender has seen it.
            self.stats.add(refused=1)
            store.set(
                verdict_key,
                json.dumps({"ok": False, "kind": type(exc).__name__, "error": str(exc)}),
            )
            logger.warning("kv receiver %s: refused %s: %s", self.endpoint, peer_id, exc)
            return
        verdict = {"ok": True, "heartbeat_s": self.timeout_s / 4}
        region = None
        if "shared_memory" in hello:
            region, declined = self._map_region(hello["shared_memory"])
            verdict["shared_memory"] = region is not None
            if region is None:
                verdict["shared_memory_declined"] = declined
        # Cloned here, not in the channel thread: close() may drop the master store any time
        # after it has joined this (accept) thread.
        channel = InboundChannel(self, index, peer_id, self._clone_store(), region)
        if self.secret is not None:
            channel.nonces = (sender_nonce, auth.new_nonce())
            verdict["nonce"] = channel.nonces[1]
            verdict["proof"] = auth.receiver_proof(self.secret, index, *channel.nonces)
        with self._lock:
            if self._closed:
                return
            self._channels[index] = channel
        store.set(verdict_key, json.dumps(verdict))
        channel.thread.start()
        logger.info("kv receiver %s: channel %d from %s%s", self.endpoint, index, peer_id,
                    " (shared memory)" if region is not None else "")

    def _map_region(self, offer: object) -> tuple[SharedRegion | None, str]:
        if not self.shared_memory:
            return None, "the receiver takes payloads over gloo only"
        if self.device.type != "cpu":
            return None, f"the receiver's KV is on {self.device}"
        return SharedRegion.attach(offer)

    def _clone_store(self) -> dist.Store:
        """A new client of the master store. Its connect is bounded by the store's timeout,
        which a loaded machine (or a short timeout_s) can exceed once: try a few times."""
        for attempt in range(_CLONE_ATTEMPTS):
            try:
                return self._store.clone()
            except RuntimeError:
                if attempt + 1 == _CLONE_ATTEMPTS:
                    raise
                logger.warning("kv receiver %s: store clone failed (attempt %d), retrying",
                               self.endpoint, attempt + 1)
        raise AssertionError("unreachable")

    def _refuse_quietly(self, store: dist.Store, hello: dict, exc: BaseException) -> None:
        """_admit failed unexpectedly: answer the sender (best effort) so that it fails now,
        with the reason, instead of waiting out its timeout for a verdict that never comes."""
        try:
            index = int(hello["index"])
            with self._lock:
                if index in self._channels:
                    return  # its verdict was written; the channel owns the index now
            store.set(channel_key(index, "verdict"), json.dumps(
                {"ok": False, "kind": "KVChannelError",
                 "error": f"decode worker could not open the channel: {exc}"}))
        except Exception:
            logger.debug("kv receiver %s: could not answer a failed hello", self.endpoint,
                         exc_info=True)

    # ---- called from channel threads ------------------------------------------------------

    def _report(self, peer_id: str, exc: BaseException) -> None:
        self.stats.add(failures=1)
        logger.warning("kv receiver %s: channel from %s failed: %s", self.endpoint, peer_id, exc)
        if self._on_channel_error is not None:
            self._call(self._on_channel_error, peer_id, exc)

    def _forget(self, channel: InboundChannel) -> None:
        with self._lock:
            if self._channels.get(channel.index) is channel:
                del self._channels[channel.index]

    def _call(self, fn: Callable, *args: object) -> object:
        try:
            return fn(*args)
        except Exception:
            self.stats.add(callback_errors=1)
            logger.exception("kv receiver %s: callback %r raised", self.endpoint, fn)
            return None
