"""The prefix index: exact from workers' stored/evicted events, falling back to this
gateway's routing history for workers whose events are missing, and briefly for blocks just
routed (events lag by a heartbeat)."""

from __future__ import annotations

from engine.block_pool import hash_prompt_blocks
from services.gateway.routing.prefix_index import PrefixIndex

SYSTEM = list(range(1000, 1064))  # 4 blocks of 16
HASHES = hash_prompt_blocks(SYSTEM + list(range(5000, 5032)), 16)  # 6 blocks


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stored_events_give_the_leading_blocks_held_and_evictions_take_them_back():
    index = PrefixIndex()
    index.apply_event("p1", "stored", HASHES[:4])
    assert index.matched_blocks("p1", "addr1", HASHES) == 4
    index.apply_event("p1", "evicted", [HASHES[2]])
    assert index.matched_blocks("p1", "addr1", HASHES) == 2  # a hole ends the prefix
    assert index.matched_blocks("p2", "addr2", HASHES) == 0
    assert index.num_blocks("p1") == 3


def test_history_is_the_fallback_for_a_worker_without_events():
    index = PrefixIndex()
    index.record_routed("addr1", HASHES[:5])
    assert index.matched_blocks("p1", "addr1", HASHES) == 5
    assert not index.is_followed("p1")


def test_for_a_followed_worker_history_counts_only_within_the_event_lag():
    clock = Clock()
    index = PrefixIndex(history_grace_s=5.0, clock=clock)
    index.apply_event("p1", "stored", HASHES[:2])
    index.record_routed("addr1", HASHES)  # just sent: its events are not in yet
    assert index.matched_blocks("p1", "addr1", HASHES) == 6
    clock.now = 6.0  # by now the events would have said so; they did not (evicted or failed)
    assert index.matched_blocks("p1", "addr1", HASHES) == 2


def test_history_is_bounded_least_recently_routed_first():
    index = PrefixIndex(history_blocks=4)
    index.record_routed("a", HASHES[:3])
    index.record_routed("b", HASHES[:3])  # pushes out two of a's oldest blocks
    assert index.matched_blocks("wb", "b", HASHES) == 3
    assert index.matched_blocks("wa", "a", HASHES) == 0


def test_history_of_a_worker_is_bounded_by_its_kv_pool():
    """A worker whose pool holds 3 blocks cannot still cache more than the last 3 blocks it was
    sent: without events, the older ones stop counting (and leave the shared history too)."""
    index = PrefixIndex(history_blocks=100)
    index.record_routed("a", HASHES[:2], capacity_blocks=3)
    index.record_routed("a", HASHES[4:6], capacity_blocks=3)  # the oldest of a's 4 drops out
    assert index.matched_blocks("wa", "a", HASHES) == 0  # HASHES[0] is gone
    assert index.matched_blocks("wa", "a", HASHES[1:2]) == 1
    assert index.matched_blocks("wa", "a", HASHES[4:6]) == 2
    index.record_routed("b", HASHES[:5])  # no capacity known: the shared bound only
    assert index.matched_blocks("wb", "b", HASHES) == 5
    index.forget_worker(address="a")
    assert index.matched_blocks("wa", "a", HASHES[4:6]) == 0
    assert index.matched_blocks("wb", "b", HASHES) == 5


def test_forgetting_a_worker_drops_its_events_and_history():
    index = PrefixIndex()
    index.apply_event("p1", "stored", HASHES)
    index.apply_event("p2", "stored", HASHES[:1])
    index.record_routed("addr1", HASHES)
    index.forget_worker("p1", "addr1")
    assert index.matched_blocks("p1", "addr1", HASHES) == 0
    assert index.matched_blocks("p2", "addr2", HASHES) == 1
    assert not index.is_followed("p1")
