"""When the cluster has room for one more request: the rule the admission dispatcher applies
before releasing a queued request, from this gateway's in-flight count and the workers' last
Health stats (decode KV blocks, prefill backlog). Owned by the gateway's event loop.

The rule, every part optional (0 turns it off):
  in flight   requests this gateway released and not finished < max_inflight, and
              < max_inflight_per_decode x routable decode workers; with no per-decode limit
              set, < the routable decode workers' own batch limits together (max_running,
              their max_num_seqs), so that no more is released than they can batch and the
              rest waits here, where the TTFT estimate sees it, not inside a worker;
  decode KV   the request's worst case (prompt + max_tokens) fits in the decode workers'
              free blocks, leaving kv_headroom of their total free (always checked);
  prefill     prompt tokens waiting on prefill workers (their queued_prefill_tokens plus what
              this gateway released since their last poll) < max_prefill_queue_tokens each.
A gateway with nothing in flight always has room, so a request larger than the rule allows
still runs, alone. With no available worker there is "room" too: the request fails fast with a
503 from the dispatcher instead of waiting out its deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.routing.worker_pool import WorkerPool


@dataclass(frozen=True)
class CapacityRule:
    max_inflight: int = 0
    max_inflight_per_decode: int = 0
    kv_headroom: float = 0.0  # fraction of KV blocks kept free, in [0, 1)
    max_prefill_queue_tokens: int = 0  # per prefill worker

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_headroom < 1.0:
            raise ValueError("--kv-headroom must be in [0, 1)")
        if min(self.max_inflight, self.max_inflight_per_decode,
               self.max_prefill_queue_tokens) < 0:
            raise ValueError("in-flight and prefill queue limits must be >= 0")


class ClusterRoom:
    def __init__(self, rule: CapacityRule, pool: WorkerPool) -> None:
        self.rule = rule
        self.pool = pool
        # What this gateway released since the workers' last poll, which the polled stats
        # cannot show yet; reset when a new Health answer replaces the old one. (Blocks freed
        # since are not credited: the stream's end can reach us after a poll that already
        # counted them, and a double count releases into a full cache.)
        self._polls: tuple[int, ...] = ()
        self._blocks_since_poll = 0
        self._prefill_tokens_since_poll = 0

    def has_room(self, inflight: int, prompt_tokens: int, blocks: int) -> bool:
        if inflight == 0:
            return True
        limit = self.inflight_limit()
        return (not limit or inflight < limit) and self.fits(prompt_tokens, blocks)

    def inflight_limit(self) -> int:
        """The in-flight part of the rule now (0: none)."""
        limits = [self.rule.max_inflight] if self.rule.max_inflight else []
        decoders = [e for e in self.pool.decoders() if e.available()]
        if decoders and self.rule.max_inflight_per_decode:
            limits.append(self.rule.max_inflight_per_decode * len(decoders))
        elif decoders and all(e.stats.max_running for e in decoders):
            limits.append(sum(e.stats.max_running for e in decoders))
        return min(limits) if limits else 0

    def fits(self, prompt_tokens: int, blocks: int) -> bool:
        """The workers' part of the rule: decode KV and the prefill backlog."""
        rule = self.rule
        decoders = [e for e in self.pool.decoders() if e.available()]
        if not decoders:
            return True
        self._catch_up()
        stats = [e.stats for e in decoders]
        free = sum(s.kv_blocks_free for s in stats) - self._blocks_since_poll
        total = sum(s.kv_blocks_total for s in stats)
        if total and (free - blocks < rule.kv_headroom * total
                      or blocks > max(s.kv_blocks_free for s in stats)):
            return False
        if rule.max_prefill_queue_tokens:
            prefillers = [e for e in self._prefillers() if e.available()]
            if prefillers:
                queued = (sum(e.stats.queued_prefill_tokens for e in prefillers)
                          + self._prefill_tokens_since_poll)
                if queued >= rule.max_prefill_queue_tokens * len(prefillers):
                    return False
        return True

    def released(self, prompt_tokens: int, blocks: int) -> None:
        self._catch_up()
        self._blocks_since_poll += blocks
        self._prefill_tokens_since_poll += prompt_tokens

    def _prefillers(self):
        return self.pool.prefillers() if self.pool.disaggregated else self.pool.decoders()

    def _catch_up(self) -> None:
        polls = tuple(id(e.health) for e in self.pool.endpoints)
        if polls != self._polls:
            self._polls = polls
            self._blocks_since_poll = 0
            self._prefill_tokens_since_poll = 0
