"""queued_prefill: minus the prompt tokens queued on a prefill worker (its last poll plus what
this gateway sent since), so that with prefix_cache the sum is work saved minus work ahead."""

from __future__ import annotations

from synthetic_workers import worker

from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.scorers.queued_prefill import QueuedPrefillScorer

REQUEST = RoutingRequest.build(range(64), max_tokens=8, block_size=16)


def test_queued_tokens_count_against_a_worker():
    scorer = QueuedPrefillScorer()
    assert scorer.score(REQUEST, worker("idle", "prefill")) == 0.0
    assert scorer.score(REQUEST, worker("busy", "prefill", queued_prefill_tokens=900)) == -900.0


def test_tokens_sent_since_the_poll_count_too():
    w = worker("a", "prefill", queued_prefill_tokens=100)
    w.prefill_tokens_since_poll = 250
    assert QueuedPrefillScorer().score(REQUEST, w) == -350.0


def test_unanswered_prefills_count_when_the_poll_shows_less():
    # The worker's queue dropped the prompt it is computing; this gateway still waits on it.
    w = worker("a", "prefill", queued_prefill_tokens=0)
    w.prefill_tokens_in_flight = 400
    assert QueuedPrefillScorer().score(REQUEST, w) == -400.0
