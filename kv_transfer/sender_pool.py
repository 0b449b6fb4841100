"""KVSenderPool: one KVSender per decode endpoint, created on first use, rebuilt after a failure."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import torch

from kv_transfer.channel import split_endpoints, tensor_parallel_mismatch
from kv_transfer.layout import KVLayout, LayoutMismatchError
from kv_transfer.sender import KVSender
from kv_transfer.shared_memory import DEFAULT_SHARED_MEMORY_BYTES
from kv_transfer.stats import KVStats

# Each sender is a thread and a process group; a prefill worker needs one per decode worker
# rank it serves, so far more than this is a caller pointing it everywhere.
DEFAULT_MAX_SENDERS = 128


class KVSenderLimitError(RuntimeError):
    """sender() refused a new endpoint: max_senders channels are already open or connecting."""


class KVSenderPool:
    """What a prefill worker holds: it sends to whichever decode worker the router picked.

    A broken sender (dead receiver, timeout) is dropped; the next send to that endpoint builds
    a fresh one, so a restarted decode worker is reached again without a restart here. Only the
    transfers queued on the broken sender fail. Thread-safe; one KVStats aggregates all senders.

    At most `max_senders` endpoints have a sender at once; a new endpoint past that raises
    KVSenderLimitError at once (broken senders are dropped first to make room).
    """

    def __init__(
        self,
        layout: KVLayout,
        device: str | torch.device = "cpu",
        timeout_s: float = 10.0,
        *,
        peer_id: str | None = None,
        max_queued: int = 64,
        tp_rank: int = 0,
        tp_size: int = 1,
        secret: bytes | None = None,
        max_senders: int = DEFAULT_MAX_SENDERS,
        shared_memory_bytes: int = DEFAULT_SHARED_MEMORY_BYTES,
    ):
        if max_senders < 1:
            raise ValueError(f"max_senders must be >= 1, got {max_senders}")
        self.layout = layout
        self.secret = secret
        self.max_senders = max_senders
        self.shared_memory_bytes = shared_memory_bytes  # each sender's region offer (KVSender)
        # Rank tp_rank of a TP-tp_size prefill worker sends to the same rank of the decode worker.
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.peer_id = peer_id
        self.max_queued = max_queued
        self.stats = KVStats()
        self._lock = threading.Lock()  # guards _senders and _closed
        self._senders: dict[str, KVSender] = {}
        self._closed = False

    def sender(self, endpoint: str) -> KVSender:
        """The usable sender for `endpoint` (as the decode worker advertised it: one host:port
        per rank), connecting (in the background) if needed. Raises LayoutMismatchError when
        the decode worker's tensor-parallel degree differs from this one's."""
        endpoints = split_endpoints(endpoint)
        if len(endpoints) != self.tp_size:
            raise LayoutMismatchError(
                f"KV endpoint {endpoint!r}: "
                + tensor_parallel_mismatch(len(endpoints), self.tp_size)
            )
        endpoint = endpoints[self.tp_rank]
        stale = None
        with self._lock:
            if self._closed:
                raise RuntimeError("KVSenderPool is closed")
            sender = self._senders.get(endpoint)
            if sender is None or not sender.usable:
                stale = sender
                if sender is None and len(self._senders) >= self.max_senders:
                    self._drop_broken()
                    if len(self._senders) >= self.max_senders:
                        raise KVSenderLimitError(
                            f"{len(self._senders)} KV channels already open (limit "
                            f"{self.max_senders}, --max-kv-senders); not opening one to {endpoint}"
                        )
                sender = KVSender(
                    endpoint,
                    self.layout,
                    self.device,
                    self.timeout_s,
                    peer_id=self.peer_id,
                    max_queued=self.max_queued,
                    stats=self.stats,
                    tp_rank=self.tp_rank,
                    tp_size=self.tp_size,
                    secret=self.secret,
                    shared_memory_bytes=self.shared_memory_bytes,
                )
                self._senders[endpoint] = sender
        if stale is not None:
            # Its thread has already exited (or is exiting) with the error; nothing to wait for.
            stale.close(cancel_pending=True, timeout_s=0)
        return sender

    def _drop_broken(self) -> None:
        """Caller holds _lock. A broken sender's thread has exited; it only holds a slot."""
        for endpoint, sender in list(self._senders.items()):
            if not sender.usable:
                del self._senders[endpoint]
                sender.close(cancel_pending=True, timeout_s=0)

    def send(
        self, endpoint: str, request_key: str, first_token: int, num_tokens: int, kv: torch.Tensor
    ) -> Future:
        """KVSender.send on the channel to `endpoint`; same errors and Future[TransferResult]."""
        return self.sender(endpoint).send(request_key, first_token, num_tokens, kv)

    def send_abort(self, endpoint: str, request_key: str) -> Future:
        return self.sender(endpoint).send_abort(request_key)

    def endpoints(self) -> list[str]:
        with self._lock:
            return list(self._senders)

    def close(self, cancel_pending: bool = False) -> None:
        with self._lock:
            self._closed = True
            senders, self._senders = list(self._senders.values()), {}
        for sender in senders:
            sender.close(cancel_pending=cancel_pending)

    def __enter__(self) -> KVSenderPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
