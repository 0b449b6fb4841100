"""Decode role: the requests whose prompt KV a prefill worker computes and sends, from the
reservation of their blocks until that KV lands (they run) or never will (recomputed here)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.pending_prefixes import PendingPrefixes
from engine.request import Request, RequestStatus


@dataclass
class Settled:
    """What a change in the reservations means for the scheduler's queues, in order."""

    # KV in, first token appended: they run.
    run: list[Request] = field(default_factory=list)
    # KV never lands: prefilled here, their first token kept if it came (appended already).
    recompute: list[Request] = field(default_factory=list)
    # Their first token, landed or kept, ends them (a stop token, max_tokens=1).
    finished: list[Request] = field(default_factory=list)


class RemoteKVReservations:
    """Reserved requests by id, and the blocks of theirs a later reservation of the same prefix
    adopts instead of having that KV sent again (PendingPrefixes). A request that adopted
    blocks starts only once their owners' KV has landed too; its own KV, if it lands first,
    waits with its first token (parked). Owned by the scheduler (the engine thread)."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.pending = PendingPrefixes(kv)

    def reserve(self, request: Request, reuse_cached_prefix: bool) -> list[int] | None:
        """Allocates blocks for the prompt now; the KV arrives later. Returns the ids of the
        blocks to receive it, or None (nothing changed) when the cache cannot hold the
        prompt. `reuse_cached_prefix`: the prompt's cached prefix blocks, and the pending ones
        after them, are adopted, not received (request.kv_reused_tokens)."""
        hits, num_hit = (self.kv.get_computed_blocks(request) if reuse_cached_prefix
                         else ([], 0))
        owners: set[str] = set()
        if reuse_cached_prefix and self.pending:
            hits = list(hits)
            owners = self.pending.adopt(request, hits)
            num_hit = len(hits) * self.kv.block_size
        new_ids = self.kv.allocate_slots(request, request.num_prompt_tokens - num_hit, hits)
        if new_ids is None:
            return None
        if reuse_cached_prefix:
            self.kv.record_prefix_lookup(request.num_tokens, num_hit)
            self.pending.add(request, len(hits))
            self.pending.follow(request.request_id, owners)
        request.kv_reused_tokens = num_hit
        request.kv_awaits = owners
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return new_ids

    def arrived(self, request_id: str, first_token: int) -> Settled | None:
        """The prompt's KV is in its reserved blocks, with the first token the prefill worker
        sampled. None: not reserved (aborted, recomputed, unknown)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        settled = Settled()
        self._arrive(request, first_token, settled)
        return settled

    def lost(self, request_id: str) -> Settled | None:
        """The KV will not come (a failed transfer, an overdue reservation): the reservation is
        dropped and the prompt recomputed here. A first token already received (parked) is
        kept, since the gateway may have streamed it. None: not reserved."""
        if request_id not in self.requests:
            return None
        settled = Settled()
        self._lose(request_id, settled)
        return settled

    def abort(self, request_id: str) -> Settled:
        """The request is gone: its reservation is dropped; requests that adopted its blocks
        are recomputed once their own first token is in."""
        settled = Settled()
        if self.requests.pop(request_id, None) is not None:
            self._settle(request_id, False, settled)
        return settled

    def overdue(self, reserved_before: float) -> list[str]:
        """Reserved before `reserved_before` (time.monotonic(); a reserved request arrives
        when it is reserved)."""
        return [rid for rid, request in self.requests.items()
                if request.arrival_time < reserved_before]

    def _arrive(self, request: Request, first_token: int, settled: Settled) -> None:
        if request.kv_awaits or request.kv_lost:  # blocks it adopted wait for KV, or lost it
            request.parked_first_token = first_token
            if request.kv_lost:
                self._lose(request.request_id, settled)
            return
        del self.requests[request.request_id]
        request.num_computed_tokens = request.num_prompt_tokens
        request.kv_arrived_ns = time.time_ns()
        request.append_output_token(first_token)
        self.kv.cache_blocks(request)
        self._settle(request.request_id, True, settled)
        (settled.finished if request.check_stop() else settled.run).append(request)

    def _lose(self, request_id: str, settled: Settled) -> None:
        request = self.requests.pop(request_id)
        self._settle(request_id, False, settled)
        self.kv.free(request)
        first_token = request.parked_first_token
        request.kv_reused_tokens = 0
        request.kv_awaits, request.parked_first_token, request.kv_lost = set(), None, False
        if first_token is not None:
            request.append_output_token(first_token)
        ended = first_token is not None and request.check_stop()
        (settled.finished if ended else settled.recompute).append(request)

    def _settle(self, owner_id: str, landed: bool, settled: Settled) -> None:
        """The owner's KV landed, or never will: its blocks are no longer adoptable. Its
        followers wait for it no longer if it landed (those whose own KV is in start now).
        Otherwise the blocks they adopted will never hold that KV, and they are recomputed,
        each once its own first token is in: the prefill worker answered that token to the
        gateway, which may have streamed it already, so it is kept, not sampled again."""
        for follower_id in self.pending.settle(owner_id):
            follower = self.requests.get(follower_id)
            if follower is None:
                continue
            follower.kv_awaits.discard(owner_id)
            if not landed:
                follower.kv_lost = True
                if follower.parked_first_token is not None:
                    self._lose(follower_id, settled)
            elif not follower.kv_awaits and follower.parked_first_token is not None:
                self._arrive(follower, follower.parked_first_token, settled)
