"""Rank r (1..N-1) of a tensor-parallel engine: a process that runs its shard of every forward
pass rank 0 sends, and moves its shard of requests' KV to and from other workers rank to rank.

The main thread owns the model runner and applies rank 0's commands in order; kv_transfer
threads only put received shards into `held` (under a lock) and report them to rank 0.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.distributed import TensorParallelGroup, new_process_group, set_tensor_parallel_group
from engine.model_runner import ModelRunner
from engine.tp_messages import (
    DropKV,
    ExecuteModel,
    GatherKV,
    KVArrived,
    KVChannelFailed,
    KVReceiverOpened,
    OpenKVReceiver,
    OpenKVSenders,
    RankFailed,
    RankReady,
    RankSpec,
    ScatterKV,
    SendKV,
    Shutdown,
    received_handle,
)

log = logging.getLogger("splitserve.tp")


def run_rank(spec: RankSpec, commands: Connection, events: Connection) -> None:
    """Process entry point. Exits when rank 0 says so, when rank 0 goes away, or on any error
    (which it reports first); never lingers as an orphan."""
    # Ctrl-C and a process-group SIGTERM are rank 0's to handle; it stops this rank itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s tp-rank-{spec.rank} %(levelname)s %(name)s: %(message)s",
    )
    _exit_with_parent(os.getppid())
    code = 0
    try:
        rank = Rank(spec, events)
        rank.serve(commands)
    except EOFError:
        log.error("rank 0 went away; exiting")
        code = 1
    except BaseException as exc:
        log.exception("tensor-parallel rank %d failed", spec.rank)
        try:
            events.send(RankFailed(spec.rank, f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        code = 1
    logging.shutdown()
    # Skip interpreter teardown: process-group destructors can block on a dead peer.
    os._exit(code)


class Rank:
    def __init__(self, spec: RankSpec, events: Connection) -> None:
        config = spec.config
        self.rank = spec.rank
        self._events = events
        self._events_lock = threading.Lock()  # the main thread and kv_transfer threads report
        self._held: dict[str, torch.Tensor] = {}
        self._held_lock = threading.Lock()
        self.receiver = None
        self.senders = None
        device = config.resolve_device()
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads or rank_threads(spec.size))
        torch.manual_seed(config.seed)
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.timeout_s))
        group = new_process_group(store, spec.rank, spec.size, device, spec.timeout_s)
        set_tensor_parallel_group(TensorParallelGroup(spec.rank, spec.size, group, device))
        self.size = spec.size
        self.runner = ModelRunner(config, ModelConfig.from_dir(config.model))
        self._emit(RankReady(spec.rank, os.getpid(), self.runner.num_blocks))
        log.info("rank %d of %d ready: %d KV blocks, %d KV heads here",
                 spec.rank, spec.size, self.runner.num_blocks, self.runner.num_kv_heads)

    def serve(self, commands: Connection) -> None:
        try:
            while True:
                message = pickle.loads(commands.recv_bytes())
                if isinstance(message, Shutdown):
                    return
                self._apply(message)
        finally:
            if self.receiver is not None:
                self.receiver.close(timeout_s=1.0)
            if self.senders is not None:
                self.senders.close(cancel_pending=True)

    def _apply(self, message: object) -> None:
        runner = self.runner
        if isinstance(message, ExecuteModel):
            # The sampled tokens equal rank 0's (the same gathered logits, the same per-request
            # generators), so this rank's request state follows without a reply.
            draft_probs = message.draft_probs and {
                rid: p.to(runner.device) for rid, p in message.draft_probs.items()}
            runner.execute_model(message.scheduler_output, draft_probs or None)
        elif isinstance(message, GatherKV):
            self._hold(message.handle, runner.gather_kv(message.block_ids))
        elif isinstance(message, ScatterKV):
            kv = self._take(message.handle)
            runner.scatter_kv(message.block_ids, kv)
            self._release(kv)
        elif isinstance(message, DropKV):
            kv = self._take(message.handle, missing_ok=True)
            if kv is not None:
                self._release(kv)
        elif isinstance(message, SendKV):
            self._send(message)
        elif isinstance(message, OpenKVReceiver):
            self._open_receiver(message)
        elif isinstance(message, OpenKVSenders):
            from kv_transfer import KVLayout, KVSenderPool

            self.senders = KVSenderPool(
                KVLayout.from_dict(message.layout), self.runner.kv_cache.device, message.timeout_s,
                tp_rank=self.rank, tp_size=self.size,
                shared_memory_bytes=message.shared_memory_bytes,
            )
        else:
            raise TypeError(f"unknown tensor-parallel command {type(message).__name__}")

    # -- KV shards ------------------------------------------------------------------------

    def _hold(self, handle: str, kv: torch.Tensor) -> torch.Tensor | None:
        with self._held_lock:
            previous = self._held.pop(handle, None)
            self._held[handle] = kv
        return previous

    def _take(self, handle: str, missing_ok: bool = False) -> torch.Tensor | None:
        with self._held_lock:
            kv = self._held.pop(handle, None)
        if kv is None and not missing_ok:
            raise RuntimeError(f"rank {self.rank} holds no KV under {handle!r}")
        return kv

    def _release(self, kv: torch.Tensor) -> None:
        # The receiver's pool takes back only buffers it lent; a gathered shard is just freed.
        if self.receiver is not None:
            self.receiver.release(kv)

    def _send(self, message: SendKV) -> None:
        kv = self._take(message.handle, missing_ok=True)
        if kv is None or self.senders is None:
            log.warning("no KV shard to send for %s", message.request_key)
            return
        try:
            future = self.senders.send(message.endpoint, message.request_key,
                                       message.first_token, message.num_tokens, kv)
        except Exception as exc:  # refused or queue full: the decode worker recomputes
            log.warning("KV shard of %s not queued: %s", message.request_key, exc)
            return
        future.add_done_callback(lambda f, key=message.request_key: _log_failure(key, f))

    def _open_receiver(self, message: OpenKVReceiver) -> None:
        from kv_transfer import KVLayout, KVReceiver

        self.receiver = KVReceiver(
            host=message.host, port=0, layout=KVLayout.from_dict(message.layout),
            device=self.runner.kv_cache.device, on_kv=self._on_kv, timeout_s=message.timeout_s,
            on_channel_error=lambda peer, exc: self._emit(KVChannelFailed(self.rank, peer, str(exc))),
            tp_rank=self.rank, tp_size=self.size, shared_memory=message.shared_memory,
        )
        self._emit(KVReceiverOpened(self.rank, self.receiver.endpoint))

    def _on_kv(self, header, payload: torch.Tensor) -> None:
        # kv_transfer channel thread: hold the shard, then tell rank 0, which orders the scatter.
        previous = self._hold(received_handle(header.request_key), payload)
        if previous is not None:
            self._release(previous)
        self._emit(KVArrived(self.rank, header.request_key))

    def _emit(self, event: object) -> None:
        with self._events_lock:
            self._events.send(event)


def rank_threads(size: int) -> int:
    """Torch threads per rank when none were asked for: the host's cores split evenly."""
    return max(1, (os.cpu_count() or 1) // size)


def _log_failure(request_key: str, future) -> None:
    if future.exception() is not None:
        log.warning("KV shard of %s failed: %s", request_key, future.exception())


def _exit_with_parent(parent_pid: int) -> None:
    """A rank whose rank 0 was killed exits within a second, even mid-collective."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()

