"""KV transfer for a tensor-parallel worker, seen from rank 0: every rank has its own KV
endpoint, and rank r of a prefill worker sends its shard to rank r of a decode worker, all
ranks in parallel. Rank 0 only coordinates: it hands a request's KV to the engine once every
rank holds its shard, and tells the other ranks when to send, scatter or drop theirs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.executor import ShardedKV, TensorParallelExecutor
from engine.llm_engine import LLMEngine
from engine.tp_messages import received_handle
from kv_transfer import KVChannelError, KVHeader, KVLayout, KVReceiver, KVSenderPool
from kv_transfer.shared_memory import DEFAULT_SHARED_MEMORY_BYTES

log = logging.getLogger(__name__)


def open_kv_receiver(engine: LLMEngine, *, host: str, port: int, layout: KVLayout,
                     device: torch.device, on_kv, timeout_s: float, on_channel_error, on_abort,
                     **checks):
    """A KVReceiver for a one-rank engine, a ShardedKVReceiver for a tensor-parallel one. Its
    `endpoint` is what the decode worker advertises; `release` takes what `on_kv` was given.
    `checks` (secret, max_blocks, check_frame, on_refused) go to rank 0's KVReceiver."""
    kwargs = dict(layout=layout, device=device, on_kv=on_kv, timeout_s=timeout_s,
                  on_channel_error=on_channel_error, on_abort=on_abort, **checks)
    if isinstance(engine.runner, TensorParallelExecutor):
        return ShardedKVReceiver(engine.runner, host, port, **kwargs)
    return KVReceiver(host=host, port=port, **kwargs)


def open_kv_senders(engine: LLMEngine, *, layout: KVLayout, device: torch.device,
                    timeout_s: float, **limits):
    """A KVSenderPool for a one-rank engine, a ShardedKVSenderPool for a tensor-parallel one.
    `limits` (secret, max_senders) go to rank 0's pool."""
    if isinstance(engine.runner, TensorParallelExecutor):
        return ShardedKVSenderPool(engine.runner, layout, device, timeout_s, **limits)
    return KVSenderPool(layout=layout, device=device, timeout_s=timeout_s, **limits)


class ShardedKVSenderPool:
    """The KVSenderPool of a tensor-parallel prefill worker. Thread-safe (the gRPC loop sends)."""

    def __init__(self, executor: TensorParallelExecutor, layout: KVLayout,
                 device: torch.device, timeout_s: float, **limits) -> None:
        self.executor = executor
        self.local = KVSenderPool(layout=layout, device=device, timeout_s=timeout_s,
                                  tp_rank=0, tp_size=executor.size, **limits)
        executor.open_kv_senders(layout.to_dict(), timeout_s,
                                 limits.get("shared_memory_bytes", DEFAULT_SHARED_MEMORY_BYTES))
        self.stats = self.local.stats

    def send(self, endpoint: str, request_key: str, first_token: int, num_tokens: int,
             kv: ShardedKV) -> Future:
        """Rank 0's shard goes first: a refusal (unequal TP, full queue) raises here, before
        any other rank sends. The future is rank 0's transfer; other ranks log their own."""
        future = self.local.send(endpoint, request_key, first_token, num_tokens, kv.local)
        self.executor.send_kv(kv, endpoint, request_key, first_token, num_tokens)
        return future

    def send_abort(self, endpoint: str, request_key: str) -> Future:
        return self.local.send_abort(endpoint, request_key)  # rank 0's receiver acts on it

    def close(self, cancel_pending: bool = False) -> None:
        self.local.close(cancel_pending=cancel_pending)  # the other ranks close theirs on exit


@dataclass
class _Arrival:
    started: float
    ranks: set[int] = field(default_factory=set)  # ranks 1..N-1 holding their shard
    header: KVHeader | None = None  # rank 0's frame, with its shard
    payload: torch.Tensor | None = None


class ShardedKVReceiver:
    """The KVReceiver of a tensor-parallel decode worker: rank 0's own plus one per other rank,
    advertised together as one comma-separated endpoint.

    `on_kv(header, ShardedKV)` runs once every rank holds its shard of a request (on a
    kv_transfer or the executor's monitor thread). A request whose shards do not all arrive
    within twice the transfer timeout (a prefill rank died) is dropped on every rank; the
    decode worker recomputes it when its wait for KV runs out. Thread-safe.
    """

    def __init__(self, executor: TensorParallelExecutor, host: str, port: int, *,
                 layout: KVLayout, device: torch.device, on_kv, timeout_s: float,
                 on_channel_error: Callable[[str, BaseException], None] | None = None,
                 on_abort=None, **checks) -> None:
        self.executor = executor
        self.timeout_s = timeout_s
        self._on_kv = on_kv
        self._on_channel_error = on_channel_error
        self._lock = threading.Lock()  # guards _arrivals
        self._arrivals: dict[str, _Arrival] = {}
        self.local = KVReceiver(host=host, port=port, layout=layout, device=device,
                                on_kv=self._arrived_here, timeout_s=timeout_s,
                                on_channel_error=on_channel_error, on_abort=on_abort,
                                tp_rank=0, tp_size=executor.size, **checks)
        executor.on_kv_arrived = self._arrived_on_rank
        executor.on_kv_channel_error = self._channel_failed_on_rank
        others = executor.open_kv_receivers(host, layout.to_dict(), timeout_s,
                                            shared_memory=checks.get("shared_memory", True))
        self.endpoint = ",".join([self.local.endpoint, *others])
        self.stats = self.local.stats

    def release(self, kv: ShardedKV) -> None:
        """The engine is done with `kv` (scattered, or dropped for a dead request)."""
        self.local.release(kv.local)
        self.executor.drop_kv(kv.handle)  # a no-op on ranks that already scattered it

    def close(self, timeout_s: float | None = None) -> None:
        self.local.close(timeout_s)

    def _arrived_here(self, header: KVHeader, payload: torch.Tensor) -> None:
        self._add(header.request_key, header=header, payload=payload)

    def _arrived_on_rank(self, rank: int, request_key: str) -> None:
        self._add(request_key, rank=rank)

    def _add(self, key: str, rank: int | None = None, header: KVHeader | None = None,
             payload: torch.Tensor | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            arrival = self._arrivals.setdefault(key, _Arrival(now))
            if rank is not None:
                arrival.ranks.add(rank)
            if header is not None:
                if arrival.payload is not None:
                    self.local.release(arrival.payload)  # a resend replaces it
                arrival.header, arrival.payload = header, payload
            complete = arrival.header is not None and len(arrival.ranks) == self.executor.size - 1
            if complete:
                del self._arrivals[key]
            stale = [(k, a) for k, a in self._arrivals.items()
                     if now - a.started > 2 * self.timeout_s]
            for k, _ in stale:
                del self._arrivals[k]
        for k, a in stale:
            log.warning("KV of %s reached ranks %s only; dropped", k,
                        sorted(a.ranks | ({0} if a.header else set())))
            if a.payload is not None:
                self.local.release(a.payload)
            self.executor.drop_kv(received_handle(k))
        if complete:
            self._on_kv(arrival.header,
                        ShardedKV(arrival.payload, received_handle(key), self.executor.size))

    def _channel_failed_on_rank(self, rank: int, peer_id: str, error: str) -> None:
        if self._on_channel_error is not None:
            self._on_channel_error(f"{peer_id} (rank {rank})", KVChannelError(error, peer_id=peer_id))
