"""When the cluster has room for one more request: the rule the admission dispatcher applies
before releasing a queued request, from this gateway's in-flight count and the workers' last
Health stats (decode KV blocks, prefill backlog). Owned by the gateway's event loop.

The rule, every part optional (0 turns it off):
  in flight   requests this gateway released and not finished < max_inflight, and
              < max_inflight_per_decode x routable decode workers; with no per-decode limit
              set, < the routable decode workers' own batch limits together (max_running,
              their max_num_seqs), so that no more is released than they can batch and the
              rest waits here, where the TTFT estimate sees it, not inside a worker;
              and a decode worker whose streams get their tokens slower than tpot_target_s
              (its reported pace, services/common/token_pace.py) counts for only the
              requests it can keep at that pace (pace_limit below);
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

# A decode worker's pace is judged once its streams' interval passes this share of the target:
# below it, more requests may come (a step's fixed costs make the proportional estimate below
# too cautious at light load).
PACE_WATCH = 0.5
# The fewest requests a slow decode worker is held to: if a handful of streams already miss
# the target, fewer would not meet it either, and batching still serves them sooner.
MIN_PACE_ROWS = 4


def pace_limit(tpot_target_s: float, token_interval_s: float, interval_rows: float) -> int:
    """The requests a decode worker can run at the target pace (0: no limit), from its own
    recent pace: an interval near or past the target scales its running count down by
    target / interval (a step's cost grows with its rows: their KV reads, their share of the
    weights' products); at MIN_PACE_ROWS and below it is not held."""
    if (not tpot_target_s or token_interval_s <= PACE_WATCH * tpot_target_s
            or interval_rows < MIN_PACE_ROWS):
        return 0
    return max(MIN_PACE_ROWS, int(interval_rows * tpot_target_s / token_interval_s))


@dataclass(frozen=True)
class CapacityRule:
    max_inflight: int = 0
    max_inflight_per_decode: int = 0
    kv_headroom: float = 0.0  # fraction of KV blocks kept free, in [0, 1)
    max_prefill_queue_tokens: int = 0  # per prefill worker
    tpot_target_s: float = 0.0  # a decode worker's pace past it limits its requests (0: off)

    def __post_init__(self) -> None:
        if not 0.0 <= self.kv_headroom < 1.0:
            raise ValueError("--kv-headroom must be in [0, 1)")
        if self.tpot_target_s < 0:
            raise ValueError("--tpot-target-s must be >= 0")
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
        per_decoder = [self.decoder_limit(e.stats) for e in decoders]
        if decoders and all(per_decoder):
            limits.append(sum(per_decoder))
        return min(limits) if limits else 0

    def decoder_limit(self, stats) -> int:
        """One decode worker's share of the in-flight limit (0: none): --max-inflight-per-decode
        or its own max_running, lowered to what it can run at the TPOT target."""
        own = self.rule.max_inflight_per_decode or stats.max_running
        pace = pace_limit(self.rule.tpot_target_s, stats.token_interval_s, stats.interval_rows)
        return min(own, pace) if own and pace else own or pace

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
