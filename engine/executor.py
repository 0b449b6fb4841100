"""Rank 0 of a tensor-parallel engine: stands in for the ModelRunner, starts ranks 1..N-1 (one
process each, all in one process group), sends them every step's SchedulerOutput and every KV
command before running its own shard, and watches them: a rank that dies fails the engine
(`on_failure`, every later call raises) instead of leaving peers hung in a collective.

Threads: the engine thread calls the runner methods; the monitor thread reads the ranks' events
and flushes drops of KV shards nobody sent. KV sends may come from the gRPC loop. One lock keeps
each command whole; every rank applies commands in the order rank 0 sent them.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import logging
import multiprocessing
import pickle
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed import (
    TensorParallelGroup,
    check_tensor_parallel_size,
    get_tp,
    new_process_group,
    set_tensor_parallel_group,
)
from engine.model_runner import ModelRunner
from engine.outputs import ModelRunnerOutput, SchedulerOutput
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
    gathered_handle,
)
from engine.tp_worker import rank_threads, run_rank
from kv_transfer.store import bound_store

log = logging.getLogger("splitserve.tp")

# A collective gives up after this long. Ranks wait for commands on a pipe, never inside a
# collective, so only a rank that hangs mid-step (or a very skewed one) reaches it.
COLLECTIVE_TIMEOUT_S = 120.0
START_TIMEOUT_S = 600.0  # spawn, import torch, load this rank's shard of the weights
_MONITOR_POLL_S = 0.5


class TensorParallelError(RuntimeError):
    """A rank died or failed; the engine cannot run another step."""


@dataclass(eq=False)
class ShardedKV:
    """A request's KV on a tensor-parallel engine: this rank's shard, plus the handle under which
    every other rank holds its own. Passed where a single engine passes its KV tensor."""

    local: torch.Tensor  # [layers, 2, blocks, block_size, kv_heads on this rank, head_dim]
    handle: str
    num_ranks: int

    @property
    def shape(self) -> torch.Size:
        return self.local.shape

    def numel(self) -> int:
        """Elements over all ranks (each ships its own shard)."""
        return self.local.numel() * self.num_ranks

    def element_size(self) -> int:
        return self.local.element_size()


def create_model_runner(config: EngineConfig, model_config: ModelConfig):
    """A ModelRunner, or for tensor_parallel_size > 1 an executor that behaves like one."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(config, model_config)
    return TensorParallelExecutor(config, model_config)


@dataclass
class _RankProcess:
    rank: int
    process: multiprocessing.process.BaseProcess
    commands: Connection
    events: Connection | None  # None once the rank is gone


class TensorParallelExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        size = config.tensor_parallel_size
        check_tensor_parallel_size(size, model_config.num_heads, model_config.num_kv_heads,
                                   model_config.intermediate_size, Path(model_config.path).name)
        self.size = size
        # Called on the monitor thread.
        self.on_failure: Callable[[str], None] | None = None
        self.on_kv_arrived: Callable[[int, str], None] | None = None
        self.on_kv_channel_error: Callable[[int, str, str], None] | None = None
        self.failure: str | None = None
        self._closing = False
        self._lock = threading.Lock()  # guards failure, _replies
        self._send_lock = threading.Lock()  # one command on the pipes at a time
        self._serials = itertools.count()
        self._replies: dict[tuple[type, int], Future] = {}
        # Appended by finalizers (any thread, any moment), so never sent from there directly.
        self._dropped: collections.deque[str] = collections.deque()
        device = config.resolve_device()
        if device.type == "cpu" and not config.num_threads:
            # The ranks share this host's cores (DESIGN: no process oversubscribes them).
            torch.set_num_threads(rank_threads(size))
        if device.type == "cuda":
            if torch.cuda.device_count() < size:
                raise ValueError(f"tensor parallel size {size} needs {size} CUDA devices, "
                                 f"{torch.cuda.device_count()} visible")
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        # The ranks' rendezvous, on loopback only (torch's own would listen everywhere).
        self._store = bound_store("127.0.0.1", 0, datetime.timedelta(seconds=START_TIMEOUT_S))
        self._ranks: list[_RankProcess] = []
        ready = [self._expect(RankReady, rank) for rank in range(1, size)]
        for rank in range(1, size):
            self._ranks.append(self._spawn(config, rank))
        self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._monitor.start()
        previous = get_tp()
        try:
            group = self._while_ranks_live(
                lambda: new_process_group(self._store, 0, size, device, COLLECTIVE_TIMEOUT_S))
            self.tp_group = TensorParallelGroup(0, size, group, device)
            # Layers capture the group when built; the global goes back for other engines.
            set_tensor_parallel_group(self.tp_group)
            try:
                self.runner = ModelRunner(config, model_config)
            finally:
                set_tensor_parallel_group(previous)
            self.rank_pids = [self._result(f).pid for f in ready]
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (pids %s), %d KV heads per rank", size,
                 ", ".join(map(str, self.rank_pids)), self.runner.num_kv_heads)

    def __getattr__(self, name: str):
        # Read-only runner facts (num_blocks, device, dtype, num_kv_heads, model, kv_cache):
        # rank 0's. Anything that changes runner state must be a method here, sent to all ranks.
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    # -- the ModelRunner interface (engine thread) -----------------------------------------

    def execute_model(self, sched: SchedulerOutput,
                      draft_probs: dict[str, torch.Tensor] | None = None) -> ModelRunnerOutput:
        shared = {rid: p.cpu() for rid, p in draft_probs.items()} if draft_probs else None
        self._broadcast(ExecuteModel(sched, shared))
        return self.runner.execute_model(sched, draft_probs)

    def gather_kv(self, block_ids: list[int]) -> ShardedKV:
        handle = gathered_handle(next(self._serials))
        self._broadcast(GatherKV(handle, list(block_ids)))
        kv = ShardedKV(self.runner.gather_kv(block_ids), handle, self.size)
        # Shards nobody sends are dropped on every rank once this object is gone.
        weakref.finalize(kv, self._dropped.append, handle)
        return kv

    def release_kv(self, kv: ShardedKV) -> None:
        """Rank 0's shard back to its pool; the other ranks' shards were never pooled."""
        self.runner.release_kv(kv.local)

    def scatter_kv(self, block_ids: list[int], payload: ShardedKV) -> None:
        if not isinstance(payload, ShardedKV):
            raise TypeError("a tensor-parallel engine takes KV as ShardedKV (one shard per rank)")
        self._broadcast(ScatterKV(payload.handle, list(block_ids)))
        self.runner.scatter_kv(block_ids, payload.local)

    # -- KV endpoints of ranks 1..N-1 (any thread) -----------------------------------------

    def open_kv_receivers(self, host: str, layout: dict, timeout_s: float,
                          shared_memory: bool) -> list[str]:
        """Each rank hosts a KV receiver; returns their endpoints in rank order."""
        replies = [self._expect(KVReceiverOpened, rank) for rank in range(1, self.size)]
        self._broadcast(OpenKVReceiver(host, layout, timeout_s, shared_memory))
        return [self._result(f, timeout_s).endpoint for f in replies]

    def open_kv_senders(self, layout: dict, timeout_s: float,
                        shared_memory_bytes: int) -> None:
        self._broadcast(OpenKVSenders(layout, timeout_s, shared_memory_bytes))

    def send_kv(self, kv: ShardedKV, endpoint: str, request_key: str, first_token: int,
                num_tokens: int) -> None:
        """Every other rank sends its shard of `kv` to its own endpoint among `endpoint`'s."""
        self._broadcast(SendKV(kv.handle, endpoint, request_key, first_token, num_tokens))

    def drop_kv(self, handle: str) -> None:
        self._broadcast(DropKV(handle))

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop every rank (politely, then by force). Idempotent."""
        if self._closing:
            return
        self._closing = True
        ranks = self._ranks
        try:
            self._broadcast(Shutdown(), check=False)
        except OSError:
            pass
        for r in ranks:
            r.process.join(timeout_s)
        self._kill_ranks()

    def _kill_ranks(self) -> None:
        for r in self._ranks:
            if r.process.is_alive():
                r.process.kill()
                r.process.join(5)

    # -- internals ---------------------------------------------------------------------------

    def _spawn(self, config: EngineConfig, rank: int) -> _RankProcess:
        context = multiprocessing.get_context("spawn")
        command_reader, command_writer = context.Pipe(duplex=False)
        event_reader, event_writer = context.Pipe(duplex=False)
        spec = RankSpec(rank, self.size, config, self._store.port, COLLECTIVE_TIMEOUT_S,
                        logging.getLevelName(logging.getLogger().getEffectiveLevel()))
        process = context.Process(target=run_rank, args=(spec, command_reader, event_writer),
                                  name=f"splitserve-tp-rank-{rank}", daemon=True)
        process.start()
        command_reader.close()
        event_writer.close()
        return _RankProcess(rank, process, command_writer, event_reader)

    def _broadcast(self, message: object, check: bool = True) -> None:
        if check and self.failure is not None:
            raise TensorParallelError(self.failure)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._send_dropped()
            for r in self._ranks:
                try:
                    r.commands.send_bytes(data)
                except OSError as exc:
                    if not check:
                        continue
                    raise TensorParallelError(
                        self.failure or f"tensor-parallel rank {r.rank} is gone ({exc})") from exc

    def _send_dropped(self) -> None:
        # Caller holds _send_lock.
        while self._dropped:
            data = pickle.dumps(DropKV(self._dropped.popleft()))
            for r in self._ranks:
                try:
                    r.commands.send_bytes(data)
                except OSError:
                    pass  # the monitor reports the dead rank

    def _expect(self, kind: type, rank: int) -> Future:
        future: Future = Future()
        with self._lock:
            if self.failure is not None:
                future.set_exception(TensorParallelError(self.failure))
            self._replies[(kind, rank)] = future
        return future

    def _result(self, future: Future, timeout_s: float = START_TIMEOUT_S):
        return future.result(timeout_s)

    def _while_ranks_live(self, fn: Callable[[], object]) -> object:
        """Run fn (a rendezvous with the ranks) but give up as soon as a rank dies."""
        done: Future = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=run, name="tp-rendezvous", daemon=True).start()
        while True:
            try:
                return done.result(0.2)
            except TimeoutError:
                if self.failure is not None:
                    raise TensorParallelError(self.failure) from None

    def _watch(self) -> None:
        while any(r.events is not None for r in self._ranks):
            live = [r for r in self._ranks if r.events is not None]
            ready = wait([r.events for r in live] + [r.process.sentinel for r in live],
                         _MONITOR_POLL_S)
            for r in live:
                if r.events in ready:
                    try:
                        event = r.events.recv()
                    except (EOFError, OSError):
                        self._lost(r)
                        continue
                    self._dispatch(event)
                elif r.process.sentinel in ready:
                    self._lost(r)
            if self._dropped and not self._closing and self.failure is None:
                with self._send_lock:
                    self._send_dropped()

    def _lost(self, r: _RankProcess) -> None:
        r.events = None
        if self._closing:
            return
        r.process.join(1)
        self._fail(f"tensor-parallel rank {r.rank} (pid {r.process.pid}) exited "
                   f"with code {r.process.exitcode}")

    def _dispatch(self, event: object) -> None:
        if isinstance(event, (RankReady, KVReceiverOpened)):
            with self._lock:
                future = self._replies.pop((type(event), event.rank), None)
            if future is not None:
                future.set_result(event)
        elif isinstance(event, KVArrived):
            if self.on_kv_arrived is not None:
                self.on_kv_arrived(event.rank, event.request_key)
        elif isinstance(event, KVChannelFailed):
            if self.on_kv_channel_error is not None:
                self.on_kv_channel_error(event.rank, event.peer_id, event.error)
        elif isinstance(event, RankFailed):
            self._fail(f"tensor-parallel rank {event.rank} failed: {event.error}")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None or self._closing:
                return
            self.failure = reason
            pending, self._replies = list(self._replies.values()), {}
        log.error("%s; stopping the other ranks", reason)
        for future in pending:
            future.set_exception(TensorParallelError(reason))
        # Peers blocked in a collective with the dead rank must not hang: stop them too (rank
        # 0's own collective then fails at once, its connections closed).
        self._kill_ranks()
        if self.on_failure is not None:
            self.on_failure(reason)
