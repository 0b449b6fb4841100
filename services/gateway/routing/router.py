"""Which workers serve a request: a decode worker, and a prefill worker or none (the decode
worker then runs the prompt itself: conditional disaggregation).

Each pool is ranked by a weighted sum of small scorers (services/gateway/routing/scorers);
ties go round-robin, so with no scorers at all this is plain round-robin. Runs on the event
loop.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.block_pool import hash_prompt_blocks
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.scorers import (
    DEFAULT_DECODE_WEIGHTS,
    DEFAULT_PREFILL_WEIGHTS,
    RoutingRequest,
    Scorer,
    build_scorers,
)
from services.gateway.routing.scorers.queued_prefill import queued_tokens
from services.gateway.routing.scorers.running_load import worker_load
from services.gateway.routing.worker_pool import WorkerEndpoint, WorkerPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Route:
    decode: WorkerEndpoint
    prefill: WorkerEndpoint | None  # None: the decode worker prefills the prompt itself
    reason: str  # why the prompt is prefilled where it is (logs, tests)
    cached_tokens: int = 0  # of the prompt, on the worker that prefills it (estimate)

    @property
    def reason_label(self) -> str:
        """`reason` as a bounded metric label: aggregated, disaggregated, local_short_prompt,
        local_no_prefill_worker or local_prefill_backlog."""
        return _REASON_LABELS.get(self.reason) or (
            "local_short_prompt" if self.reason.startswith("local") else self.reason)


_REASON_LABELS = {
    "local: no prefill worker available": "local_no_prefill_worker",
    "local: every prefill worker failed this request": "local_no_prefill_worker",
    "local: every prefill worker is backed up": "local_prefill_backlog",
}


class Router(Protocol):
    def route(self, prompt_token_ids: Sequence[int], max_tokens: int,
              exclude: Collection[str] = (), cache_salt: str = "",
              local: str = "", failed_at: Mapping[str, float] | None = None) -> Route | None:
        """Workers for one attempt, avoiding addresses in `exclude` unless none other is
        left; None when no worker can take it now. `local`: the decode worker alone, for
        this reason. `failed_at`: decode workers (address -> monotonic time) that failed this
        request, never chosen until a Health poll begun since found them serving."""

    def ready(self) -> bool:
        """Whether requests can be routed at all."""


class ScoringRouter:
    """Decode: the highest weighted score (default: free KV share + running load). Prefill:
    likewise among prefill workers serving the same model as that decode worker (default:
    prompt tokens cached there minus tokens queued there).

    Prefix affinity (decode): a worker that already holds most of the prompt (at least half of
    its tokens and 4 blocks, by the prefix index) takes it while its load (requests running,
    queued or waiting for KV) is at most `decode_affinity_slack` requests, or its least
    loaded peer's load, whichever is more, above that peer's: a chat's next turn goes back to
    the worker holding its history instead of prefilling it again elsewhere (aggregated) or
    receiving all of its KV (disaggregated), and a popular prefix spreads once its holder is
    about twice as busy. Negative: off, the scorers alone decide.

    Conditional disaggregation: the decode worker prefills the prompt itself when the part
    of it not in that worker's cache is at most `local_prefill_tokens` (0: never), or when
    every prefill worker has at least `prefill_backlog_tokens` queued (and the decode worker's
    own queue, with this prompt, is no longer than the shortest of theirs) or none is available
    (0: never; wait for a prefill worker instead)."""

    def __init__(self, pool: WorkerPool, index: PrefixIndex | None = None,
                 decode_scorers: Sequence[tuple[Scorer, float]] | None = None,
                 prefill_scorers: Sequence[tuple[Scorer, float]] | None = None,
                 local_prefill_tokens: int = 0, prefill_backlog_tokens: int = 0,
                 decode_affinity_slack: int = -1) -> None:
        self.pool = pool
        self.index = index or PrefixIndex()
        if decode_scorers is None:
            decode_scorers = build_scorers(DEFAULT_DECODE_WEIGHTS, self.index)
        if prefill_scorers is None:
            prefill_scorers = build_scorers(DEFAULT_PREFILL_WEIGHTS, self.index)
        self.decode_scorers = list(decode_scorers)
        self.prefill_scorers = list(prefill_scorers)
        self.local_prefill_tokens = local_prefill_tokens
        self.prefill_backlog_tokens = prefill_backlog_tokens
        self.decode_affinity_slack = decode_affinity_slack
        self._decode_turn: Iterator[int] = itertools.count()
        self._prefill_turn: Iterator[int] = itertools.count()

    def ready(self) -> bool:
        if not any(e.available() for e in self.pool.decoders()):
            return False
        if self.pool.disaggregated and not self.prefill_backlog_tokens:
            return any(e.available() for e in self.pool.prefillers())
        return True

    def route(self, prompt_token_ids: Sequence[int], max_tokens: int,
              exclude: Collection[str] = (), cache_salt: str = "",
              local: str = "", failed_at: Mapping[str, float] | None = None) -> Route | None:
        """`cache_salt`: the tenant's, so only its own (or its group's) cached blocks count.
        `local`: a reason the decode worker computes the tokens itself (a migration's
        recompute): no prefill worker is chosen, nor booked with work it never gets (one was,
        its breaker's half-open trial included)."""
        request = RoutingRequest.build(prompt_token_ids, max_tokens, self.pool.block_size(),
                                       cache_salt)
        # The pool's endpoint now, not the one that failed: a registry worker that left and
        # came back on its address is a new endpoint object, polled anew.
        failed_at = failed_at or {}
        decoders = [e for e in self.pool.decoders()
                    if e.serving_polled_at > failed_at.get(e.address, -1.0)]
        decode = (self._holder(request, exclude, decoders)
                  or _best(decoders, self.decode_scorers, request, exclude, self._decode_turn))
        if decode is None:
            return None
        route = (Route(decode, None, local, self._cached_tokens(request, decode)) if local
                 else self._place_prefill(request, decode, exclude))
        if route is not None:
            self._commit(request, route)
        return route

    def _holder(self, request: RoutingRequest, exclude: Collection[str],
                decoders: Sequence[WorkerEndpoint]) -> WorkerEndpoint | None:
        """Prefix affinity (see the class): the decode-capable worker holding most of the
        prompt, if it may take it; None leaves the choice to the scorers."""
        if self.decode_affinity_slack < 0 or len(request.block_hashes) < _AFFINITY_MIN_BLOCKS:
            return None
        candidates = _prefer_unexcluded([e for e in decoders if e.available()], exclude)
        if len(candidates) < 2:
            return None
        held = {e.address: self.index.matched_blocks(e.worker_id, e.address,
                                                     request.block_hashes)
                for e in candidates}
        holder = max(candidates, key=lambda e: (held[e.address], -worker_load(e)))
        held_tokens = held[holder.address] * request.block_size
        if held[holder.address] < _AFFINITY_MIN_BLOCKS or 2 * held_tokens < request.num_tokens:
            return None
        least = min(worker_load(e) for e in candidates)
        if worker_load(holder) > least + max(self.decode_affinity_slack, least):
            return None
        # Room for the request's blocks, counting what this gateway sent since the last poll.
        if holder.stats.kv_blocks_free - holder.blocks_since_poll < request.blocks_needed:
            return None
        return holder

    def _place_prefill(self, request: RoutingRequest, decode: WorkerEndpoint,
                       exclude: Collection[str]) -> Route | None:
        cached_on_decode = self._cached_tokens(request, decode)
        if decode.role == "both" or not self.pool.disaggregated:
            return Route(decode, None, "aggregated", cached_on_decode)
        uncached = request.num_tokens - cached_on_decode
        if self.local_prefill_tokens and uncached <= self.local_prefill_tokens:
            return Route(decode, None, f"local: {uncached} uncached tokens", cached_on_decode)
        candidates = [p for p in self.pool.prefillers()
                      if p.available() and _same_model(p, decode)]
        if not candidates:
            if self.prefill_backlog_tokens:
                return Route(decode, None, "local: no prefill worker available",
                             cached_on_decode)
            return None
        if self.prefill_backlog_tokens and all(p.address in exclude for p in candidates):
            # Every prefill worker failed this request already (a crash the health poll has
            # not seen yet): the retry prefills on the decode worker, not on the worker that
            # just failed; with one prefill worker, as `splitserve up` runs, 2 of 4 long
            # prompts queued there got a 503 when it was killed.
            return Route(decode, None, "local: every prefill worker failed this request",
                         cached_on_decode)
        if self.prefill_backlog_tokens:
            # Only where the decode worker's own line is shorter: its earlier local prefills
            # (spilled before, paced by its step-time target) are ahead of this one.
            least = min(queued_tokens(p) for p in candidates)
            if (least >= self.prefill_backlog_tokens
                    and queued_tokens(decode) + uncached <= least):
                return Route(decode, None, "local: every prefill worker is backed up",
                             cached_on_decode)
        prefill = _best(candidates, self.prefill_scorers, request, exclude, self._prefill_turn)
        return Route(decode, prefill, "disaggregated", self._cached_tokens(request, prefill))

    def _cached_tokens(self, request: RoutingRequest, worker: WorkerEndpoint) -> int:
        blocks = self.index.matched_blocks(worker.worker_id, worker.address, request.block_hashes)
        return blocks * request.block_size

    def _commit(self, request: RoutingRequest, route: Route) -> None:
        """Count what was just sent, until the next Health poll reports it."""
        decode, prefill = route.decode, route.prefill
        decode.blocks_since_poll += request.blocks_needed
        decode.requests_since_poll += 1
        decode.breaker.on_routed()
        # The decode worker ends up holding the prompt's blocks either way (received or computed).
        self.index.record_routed(decode.address, request.block_hashes,
                                 decode.stats.kv_blocks_total)
        if prefill is not None:
            prefill.prefill_tokens_since_poll += request.num_tokens - route.cached_tokens
            prefill.breaker.on_routed()
            self.index.record_routed(prefill.address, request.block_hashes,
                                     prefill.stats.kv_blocks_total)
        elif decode.role == "decode":  # prefilled there: in its line until the next poll
            decode.prefill_tokens_since_poll += request.num_tokens - route.cached_tokens
        log.debug("route decode=%s prefill=%s (%s, %d cached)", decode.address,
                  prefill.address if prefill else "-", route.reason, route.cached_tokens)


_AFFINITY_MIN_BLOCKS = 4  # a held prefix shorter than this saves too little to steer by


def _best(endpoints: Sequence[WorkerEndpoint], scorers: Sequence[tuple[Scorer, float]],
          request: RoutingRequest, exclude: Collection[str],
          turn: Iterator[int]) -> WorkerEndpoint | None:
    candidates = _prefer_unexcluded([e for e in endpoints if e.available()], exclude)
    if not candidates:
        return None
    scores = [sum(weight * scorer.score(request, e) for scorer, weight in scorers)
              for e in candidates]
    top = max(scores)
    tied = [e for e, s in zip(candidates, scores, strict=True) if s >= top - 1e-9 * max(1.0, abs(top))]
    return tied[next(turn) % len(tied)]


def _prefer_unexcluded(endpoints: list[WorkerEndpoint], exclude: Collection[str]) -> list[WorkerEndpoint]:
    fresh = [e for e in endpoints if e.address not in exclude]
    return fresh or endpoints


def _same_model(a: WorkerEndpoint, b: WorkerEndpoint) -> bool:
    """KV moves only between workers of one model version (unknown matches anything)."""
    return not a.model or not b.model or a.model == b.model


def cached_prompt_tokens(index: PrefixIndex, pool: WorkerPool, prompt_token_ids: Sequence[int],
                         cache_salt: str = "") -> int:
    """How much of a prompt is already in the prefix cache of the available worker that holds
    the most of it, among those that may prefill it (any worker: a decode worker prefills
    what conditional disaggregation keeps local). An estimate, as routing's: the workers'
    block events where they publish them, else this gateway's routing history."""
    workers = [w for w in (*pool.prefillers(), *pool.decoders()) if w.available()]
    if not workers or not prompt_token_ids:
        return 0
    block_size = pool.block_size()
    hashes = hash_prompt_blocks(prompt_token_ids, block_size, cache_salt)
    held = max(index.matched_blocks(w.worker_id, w.address, hashes) for w in workers)
    # A prefix a prompt admitted a moment ago brings is computed before this one's turn.
    return max(held, index.matched_admitted(hashes)) * block_size


def note_admitted_prompt(index: PrefixIndex, pool: WorkerPool, prompt_token_ids: Sequence[int],
                         cache_salt: str = "") -> None:
    """Admission let this prompt in (cached_prompt_tokens counts its blocks for a while)."""
    if prompt_token_ids:
        index.record_admitted(hash_prompt_blocks(prompt_token_ids, pool.block_size(),
                                                 cache_salt))
