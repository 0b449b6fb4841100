"""running_load: 1/(1 + requests running, waiting or waiting for KV), plus the requests this
gateway sent since the last poll."""

from __future__ import annotations

from synthetic_workers import worker

from services.gateway.routing.scorers.base import RoutingRequest
from services.gateway.routing.scorers.running_load import RunningLoadScorer

REQUEST = RoutingRequest.build(range(8), max_tokens=8, block_size=16)


def test_idle_worker_scores_one_and_load_lowers_it():
    scorer = RunningLoadScorer()
    assert scorer.score(REQUEST, worker("idle")) == 1.0
    assert scorer.score(REQUEST, worker("busy", running=2, waiting=1, waiting_for_kv=1)) == 0.2


def test_requests_sent_since_the_poll_count_at_once():
    w = worker("a", running=1)
    before = RunningLoadScorer().score(REQUEST, w)
    w.requests_since_poll = 2
    assert RunningLoadScorer().score(REQUEST, w) == 0.25 < before
