"""The decode role's side of disaggregation, as the services drive it: blocks reserved for a
prompt a prefill worker computes, its KV written into them on arrival, and the fallbacks.

Driven by the engine's thread like the rest of LLMEngine (`engine.remote`); not thread-safe.
The scheduler's bookkeeping of these reservations is engine/remote_kv.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


class KVCacheFull(RuntimeError):
    """Not enough free KV blocks right now to reserve room for a prompt (retryable)."""


@dataclass(frozen=True)
class RemoteReservation:
    """What reserve set aside: the blocks to receive KV into, after the first
    `num_cached_tokens` prompt tokens, whose KV this worker already held."""

    block_ids: list[int]
    num_cached_tokens: int = 0


class RemotePrefill:
    def __init__(self, block_size: int, scheduler: Scheduler, kv: KVCacheManager, runner,
                 make_request: Callable[..., Request]) -> None:
        self.block_size = block_size
        self.scheduler = scheduler
        self.kv = kv
        self.runner = runner
        self._make_request = make_request  # LLMEngine's: validates, seeds, caps the length
        self.num_reserved = 0  # reservations made, ever (a prompt on its way to a prefill worker)
        self.latest_reserved = ""  # the request id of the latest

    def reserve(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        priority: int = 0, cache_salt: str = "", reuse_cached_prefix: bool = False,
    ) -> RemoteReservation:
        """Reserve blocks for a prompt whose KV a prefill worker will send; raises KVCacheFull
        at once if they don't fit. `reuse_cached_prefix`: the prompt's prefix this worker
        caches (whole blocks, never the whole prompt) is adopted, and the KV to come is the
        rest's only."""
        request = self._make_request(request_id, prompt_token_ids, params, priority, False, None,
                                     cache_salt)
        block_ids = self.scheduler.reserve_for_remote_kv(request, reuse_cached_prefix)
        if block_ids is None:
            raise KVCacheFull(
                f"{cdiv(len(prompt_token_ids), self.block_size)} KV blocks needed, "
                f"{self.kv.num_free_blocks} free"
            )
        self.num_reserved += 1
        self.latest_reserved = request_id
        return RemoteReservation(block_ids, request.kv_reused_tokens)

    def awaits_prompt_since(self, seen: int) -> bool:
        """Whether the latest reservation came after the `seen`-th and still waits for its
        KV: its prompt is at a prefill worker, or on its way there."""
        return (self.num_reserved != seen
                and self.latest_reserved in self.scheduler.waiting_for_kv)

    def receive(self, request_id: str, first_token: int, payload) -> RequestOutput | None:
        """Write a prompt's received KV (`payload`, [layers, 2, blocks, block_size, kv_heads,
        head_dim], one block per reserved block: the prompt's after any it reused) into its
        reserved blocks and start decoding it. Returns an output only when the first token
        already finished the request. A missing or misshapen payload raises ValueError and
        changes nothing."""
        if payload is None:
            raise ValueError(
                f"receive({request_id!r}) got no KV payload: the blocks would be marked "
                "computed and cached with nothing written (the profiler, which wants exactly "
                "that, calls start_for_profiling)"
            )
        request = self.scheduler.waiting_for_kv.get(request_id)
        if request is None:
            return None  # aborted meanwhile: the payload is dropped
        if request.kv_lost:  # blocks it adopted will never get their KV: recomputed here
            return self._arrived(request, first_token)
        reused_blocks = request.kv_reused_tokens // self.block_size
        block_ids = self.kv.block_ids(request_id)[reused_blocks:]
        shape = tuple(payload.shape)
        if len(shape) != 6 or shape[2] != len(block_ids):
            raise ValueError(
                f"KV payload for {request_id!r} has shape {shape}; expected 6 dims with "
                f"{len(block_ids)} blocks on axis 2 (the blocks reserved for its prompt)"
            )
        copy_started = time.perf_counter()
        self.runner.scatter_kv(block_ids, payload)
        request.transfer_seconds += time.perf_counter() - copy_started
        return self._arrived(request, first_token)

    def start_for_profiling(self, request_id: str, first_token: int) -> RequestOutput | None:
        """Profiler only (services/autoscaler/profiler.py): start decoding a reserved request
        as if its KV had arrived, writing none, because the values do not change a step's
        time. Its blocks hold whatever was there, so they never enter the prefix cache."""
        request = self.scheduler.waiting_for_kv.get(request_id)
        if request is None:
            return None
        self.kv.exclude_from_prefix_cache(request)
        return self._arrived(request, first_token)

    def recompute_locally(self, request_id: str) -> bool:
        """The KV will not come (its prefill worker failed): prefill the prompt here instead."""
        return self.scheduler.recompute_locally(request_id)

    def _arrived(self, request: Request, first_token: int) -> RequestOutput | None:
        self.scheduler.remote_kv_arrived(request.request_id, first_token)
        if not request.is_finished:
            return None
        return RequestOutput(
            request_id=request.request_id, new_token_ids=[], finished=True,
            finish_reason=request.finish_reason, num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            kv_reused_tokens=request.kv_reused_tokens,
            num_output_tokens=request.num_output_tokens, compute=request.compute_seconds,
            first_scheduled_ns=request.first_scheduled_ns, kv_arrived_ns=request.kv_arrived_ns,
        )
