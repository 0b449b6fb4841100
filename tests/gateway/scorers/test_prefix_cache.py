"""prefix_cache: prompt tokens held in the worker's prefix cache, counted in whole leading
blocks as the prefix index (events, else routing history) reports them."""

from __future__ import annotations

from synthetic_workers import worker

from engine.block_pool import hash_prompt_blocks
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.scorers.prefix_cache import PrefixCacheScorer

PROMPT = list(range(100, 170))  # 70 tokens: 4 full blocks of 16


def test_scores_the_cached_leading_blocks_in_tokens():
    index = PrefixIndex()
    holder, other = worker("a", "prefill"), worker("b", "prefill")
    hashes = hash_prompt_blocks(PROMPT, 16)
    index.apply_event(holder.worker_id, "stored", hashes[:3])
    scorer = PrefixCacheScorer(index)
    request = RoutingRequest.build(PROMPT, 8, 16)
    assert scorer.score(request, holder) == 48.0
    assert scorer.score(request, other) == 0.0


def test_a_different_first_block_matches_nothing():
    index = PrefixIndex()
    holder = worker("a", "prefill")
    index.apply_event(holder.worker_id, "stored", hash_prompt_blocks(PROMPT, 16))
    changed = [7] + PROMPT[1:]  # the chain hash makes every later block differ too
    assert PrefixCacheScorer(index).score(RoutingRequest.build(changed, 8, 16), holder) == 0.0
