"""free_kv: the share of a decode worker's KV blocks that is free, counting the blocks this
gateway reserved since the last poll as taken."""

from __future__ import annotations

from synthetic_workers import worker

from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.scorers.free_kv import FreeKVScorer

REQUEST = RoutingRequest.build(range(40), max_tokens=24, block_size=16)


def test_more_free_blocks_score_higher():
    roomy = worker("a", kv_blocks_total=100, kv_blocks_free=80)
    tight = worker("b", kv_blocks_total=100, kv_blocks_free=20)
    scorer = FreeKVScorer()
    assert scorer.score(REQUEST, roomy) == 0.8
    assert scorer.score(REQUEST, tight) == 0.2


def test_blocks_reserved_since_the_poll_count_as_used():
    w = worker("a", kv_blocks_total=100, kv_blocks_free=50)
    w.blocks_since_poll = 30
    assert FreeKVScorer().score(REQUEST, w) == 0.2
    w.blocks_since_poll = 80  # more than the poll saw free: clamped, never negative
    assert FreeKVScorer().score(REQUEST, w) == 0.0


def test_a_worker_that_never_answered_scores_zero():
    w = worker("a")
    w.health = None
    assert FreeKVScorer().score(REQUEST, w) == 0.0
