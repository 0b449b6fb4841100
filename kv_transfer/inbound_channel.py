"""InboundChannel: the decode side of one KV channel, on its own thread: it proves the peer
(with a cluster secret), builds the process group, and reads, checks and hands over frames.

Created and started by KVReceiver's accept thread; everything in it is owned by its thread.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from kv_transfer import auth
from kv_transfer.channel import RECEIVER_RANK, KVChannel, KVChannelError, channel_key, timedelta
from kv_transfer.frame_check import check_data_frame
from kv_transfer.header import HEADER_NBYTES, HeaderError, HeaderFlag, KVHeader, header_from_bytes
from kv_transfer.layout import LayoutMismatchError

if TYPE_CHECKING:
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.shared_memory import SharedRegion

logger = logging.getLogger("kv_transfer.receiver")

# Pushed by KVReceiver.close() into a queue a thread is blocked on, to wake it.
WAKE = b"wake"


class InboundChannel:
    """Receiver side of one channel. Everything here is owned by `self.thread`, except
    `stopping`, which close() sets (a plain bool flip, read between frames)."""

    def __init__(self, receiver: KVReceiver, index: int, peer_id: str, store: dist.Store,
                 region: SharedRegion | None = None):
        self.receiver = receiver
        self.region = region  # mapped by the accept thread when the sender offered one
        self.store = store
        self.index = index
        self.peer_id = peer_id
        self.stopping = False
        self.nonces: tuple[str, str] | None = None  # (sender's, ours) with a cluster secret
        self.frame_key: bytes | None = None  # tags this channel's frames once authenticated
        self.thread = threading.Thread(
            target=self._run, name=f"kv-recv-{index}-{peer_id}", daemon=True
        )

    def _run(self) -> None:
        r = self.receiver
        store = self.store
        store.set_timeout(timedelta(r.timeout_s))
        channel = None
        try:
            if self.nonces is not None and not self._authenticate(store):
                return
            channel = KVChannel(store, self.index, RECEIVER_RANK, r.device, r.timeout_s,
                                self.region)
            r.stats.add(channels_opened=1)
            self._read_frames(store, channel)
        except Exception as exc:
            if not self.stopping:
                if not isinstance(exc, KVChannelError):
                    exc = _wrap(exc, self.peer_id)
                r._report(self.peer_id, exc)
        finally:
            self.region = None
            if channel is not None:
                channel.close()
                r.stats.add(channels_closed=1)
            try:
                store.set(channel_key(self.index, "closed"), b"1")
            except RuntimeError:
                pass  # the store is gone with a closing receiver; nobody is left to tell
            r._forget(self)

    def _authenticate(self, store: dist.Store) -> bool:
        """Before the process group exists: the sender answers our challenge, or the channel
        ends here (its `closed` key is set on the way out)."""
        r = self.receiver
        key = channel_key(self.index, "auth")
        try:
            store.wait([key], timedelta(r.timeout_s))
            answer = store.get(key).decode("ascii", "replace")
        except RuntimeError:
            answer = ""
        expected = auth.sender_proof(r.secret, self.index, *self.nonces, self.peer_id)
        ok = auth.proof_ok(expected, answer)
        store.set(channel_key(self.index, "auth_verdict"), b"ok" if ok else b"refused")
        if not ok:
            r.stats.add(auth_failures=1, refused=1)
            logger.warning("kv receiver %s: channel %d from %s did not prove the cluster "
                           "secret; closed", r.endpoint, self.index, self.peer_id)
            return False
        self.frame_key = auth.session_key(r.secret, self.index, *self.nonces)
        return True

    def _read_frames(self, store: dist.Store, channel: KVChannel) -> None:
        r = self.receiver
        bell = channel_key(self.index, "bell")
        expected_seq = 0
        while not self.stopping:
            try:
                raw = store.queue_pop(bell, True)
            except RuntimeError as exc:
                if self.stopping:
                    return
                raise KVChannelError(
                    f"no frame or heartbeat from {self.peer_id} for {r.timeout_s}s: presumed dead",
                    peer_id=self.peer_id,
                ) from exc
            if self.stopping:
                return
            if raw == WAKE:
                continue
            if self.frame_key is not None:
                frame = auth.untag_frame(self.frame_key, raw, HEADER_NBYTES)
                if frame is None:  # not from our peer: some other store client wrote it
                    r.stats.add(refused_frames=1)
                    logger.warning("kv receiver %s: dropped a frame with a bad tag on channel "
                                   "%d", r.endpoint, self.index)
                    continue
                raw = frame
            try:
                header = header_from_bytes(raw)
                if header.seq == expected_seq and not header.flags & HeaderFlag.CLOSE:
                    r.layout.check_compatible(header.layout, self_name="decode",
                                              other_name="prefill")
            except (HeaderError, LayoutMismatchError) as exc:
                # Whether a payload follows is unknown, so the channel cannot stay in step.
                r.stats.add(refused_frames=1)
                raise KVChannelError(f"bad frame from {self.peer_id}: {exc}",
                                     peer_id=self.peer_id) from exc
            if header.seq != expected_seq:
                raise KVChannelError(
                    f"frame {header.seq} from {self.peer_id} out of sequence (want {expected_seq})",
                    peer_id=self.peer_id,
                )
            expected_seq += 1
            if header.flags & HeaderFlag.CLOSE:
                logger.info("kv receiver %s: %s closed its channel", r.endpoint, self.peer_id)
                return
            if header.flags & HeaderFlag.HEARTBEAT:
                continue
            if header.flags & HeaderFlag.ABORT:
                r.stats.add(aborts=1)
                if r._on_abort is not None:
                    r._call(r._on_abort, header)
                continue
            self._receive_payload(header, channel)

    def _receive_payload(self, header: KVHeader, channel: KVChannel) -> None:
        r = self.receiver
        reason = check_data_frame(header, r.layout, r.max_blocks)
        if reason is None and r._check_frame is not None:
            try:
                reason = r._check_frame(header)
            except Exception as exc:  # a rule that cannot decide refuses
                r.stats.add(callback_errors=1)
                reason = f"check_frame raised {exc!r}"
        if reason is not None:
            self._refuse(header, str(reason), channel)
            return
        wanted = True
        if r._is_wanted is not None:
            answer = r._call(r._is_wanted, header.request_key)
            wanted = True if answer is None else bool(answer)
        payload = r._pool.acquire(r.layout.payload_shape(header.num_blocks), r.layout.torch_dtype)
        start = time.perf_counter()
        try:
            channel.recv(payload)
        except KVChannelError as exc:
            # The header arrived but its payload did not: discard, and say which request lost it.
            exc.peer_id, exc.request_key = self.peer_id, header.request_key
            raise
        seconds = time.perf_counter() - start
        if not wanted:
            # Received in full even so: the bytes were already on the wire, and skipping them
            # would desynchronise the channel.
            r._pool.release(payload)
            r.stats.add(dropped=1)
            return
        shared = payload.nbytes if channel.uses_region(payload) else 0
        r.stats.add(transfers=1, bytes=payload.nbytes, shared_bytes=shared, seconds=seconds)
        r._call(r._on_kv, header, payload)

    def _refuse(self, header: KVHeader, reason: str, channel: KVChannel) -> None:
        """Fail the frame's request, never the worker; keep the channel if its payload can be
        read into a bounded buffer and thrown away."""
        r = self.receiver
        r.stats.add(refused_frames=1)
        logger.warning("kv receiver %s: refused KV for %.80r from %s: %s", r.endpoint,
                       header.request_key, self.peer_id, reason)
        if r._on_refused is not None:
            r._call(r._on_refused, header, reason)
        if r.max_blocks is None or header.num_blocks > r.max_blocks:
            raise KVChannelError(
                f"refused a frame of {header.num_blocks} blocks from {self.peer_id} ({reason}); "
                "its payload is not read, so the channel is closed",
                peer_id=self.peer_id, request_key=header.request_key,
            )
        payload = r._pool.acquire(r.layout.payload_shape(header.num_blocks), r.layout.torch_dtype)
        try:
            channel.recv(payload)
        finally:
            r._pool.release(payload)


def _wrap(exc: Exception, peer_id: str) -> KVChannelError:
    wrapped = KVChannelError(f"channel from {peer_id} failed: {exc}", peer_id=peer_id)
    wrapped.__cause__ = exc
    return wrapped
