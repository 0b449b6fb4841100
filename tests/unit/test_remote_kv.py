"""The remote-KV reservations (engine/remote_kv.py) on their own: what each event tells the
scheduler (`Settled`: run, recompute, finished), for a first prompt and a follower that adopted
its blocks, and that every block is free at the end."""

from __future__ import annotations

import itertools

from engine.kv_cache_manager import KVCacheManager
from engine.remote_kv import RemoteKVReservations
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams

BLOCK = 4
_arrival = itertools.count()
SHARED = [(11 + 7 * i) % 90 + 5 for i in range(12)]  # three full blocks both prompts start with


def _request(rid: str, tail: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, SHARED + tail, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   arrival_time=next(_arrival))


def _first_and_follower(max_tokens: int = 4):
    reservations = RemoteKVReservations(KVCacheManager(32, BLOCK, True))
    first, follower = _request("first", [1, 2, 3]), _request("follower", [4, 5], max_tokens)
    assert reservations.reserve(first, reuse_cached_prefix=True) is not None
    assert reservations.reserve(follower, reuse_cached_prefix=True) is not None
    assert follower.kv_reused_tokens == 12 and follower.kv_awaits == {"first"}
    return reservations, first, follower


def _names(requests: list[Request]) -> list[str]:
    return [r.request_id for r in requests]


def test_a_follower_whose_kv_lands_first_waits_for_the_first_prompts():
    reservations, first, follower = _first_and_follower()
    parked = reservations.arrived("follower", 77)
    assert parked.run == parked.recompute == parked.finished == []
    assert follower.parked_first_token == 77 and follower.num_output_tokens == 0
    settled = reservations.arrived("first", 66)
    assert _names(settled.run) == ["follower", "first"] and not settled.recompute
    assert follower.output_token_ids == [77] and first.output_token_ids == [66]
    assert follower.num_computed_tokens == follower.num_prompt_tokens
    assert not reservations.requests and not reservations.pending


def test_a_lost_first_prompt_sends_a_parked_follower_to_recompute_with_its_token():
    reservations, first, follower = _first_and_follower()
    reservations.arrived("follower", 77)
    settled = reservations.lost("first")
    assert _names(settled.recompute) == ["follower", "first"] and not settled.run
    assert follower.output_token_ids == [77] and follower.kv_reused_tokens == 0
    assert first.output_token_ids == [] and first.num_computed_tokens == 0
    assert reservations.kv.num_free_blocks == 32
    assert reservations.lost("first") is None and reservations.arrived("first", 5) is None


def test_an_aborted_first_prompt_leaves_its_follower_to_recompute_when_its_token_comes():
    reservations, first, follower = _first_and_follower()
    settled = reservations.abort("first")
    assert settled.run == settled.recompute == [] and follower.kv_lost
    # The scheduler frees an aborted request's blocks; the follower holds the ones it adopted.
    reservations.kv.free(first)
    later = reservations.arrived("follower", 77)
    assert _names(later.recompute) == ["follower"] and follower.output_token_ids == [77]
    assert reservations.kv.num_free_blocks == 32


def test_a_first_token_that_ends_a_request_is_reported_finished():
    reservations, first, follower = _first_and_follower(max_tokens=1)
    reservations.arrived("follower", 77)
    settled = reservations.arrived("first", 66)
    assert _names(settled.finished) == ["follower"] and _names(settled.run) == ["first"]
    assert follower.status == RequestStatus.FINISHED_LENGTH


def test_overdue_reservations_are_those_reserved_before_the_cutoff():
    reservations, first, follower = _first_and_follower()
    assert reservations.overdue(first.arrival_time + 0.5) == ["first"]
    assert sorted(reservations.overdue(follower.arrival_time + 1)) == ["first", "follower"]
