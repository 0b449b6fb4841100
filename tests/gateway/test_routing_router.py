"""The scoring router over synthetic workers: weighted scorers per pool, round-robin among
ties, prefix-aware prefill placement, conditional disaggregation, model-version pairing and
workers out of rotation."""

from __future__ import annotations

import grpc
import pytest
from splitserve.v1 import common_pb2
from synthetic_workers import StaticPool, worker

from engine.block_pool import hash_prompt_blocks
from services.gateway.config import GatewayConfig
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.router import ScoringRouter
from services.gateway.routing.scorers import (
    DEFAULT_DECODE_WEIGHTS,
    DEFAULT_PREFILL_WEIGHTS,
    build_scorers,
    parse_weights,
)

SYSTEM = list(range(1000, 1256))  # a 256-token shared prefix: 16 blocks


def prompt(user: int, length: int = 32) -> list[int]:
    return SYSTEM + [user] * length


def router(*endpoints, index=None, **kw) -> ScoringRouter:
    return ScoringRouter(StaticPool(*endpoints), index or PrefixIndex(), **kw)


def test_decode_goes_to_the_worker_with_free_blocks_and_little_running():
    full = worker("full", kv_blocks_free=100)
    busy = worker("busy", running=9)
    good = worker("good", kv_blocks_free=900, running=1)
    route = router(full, busy, good).route(prompt(1), 16)
    assert route.decode is good and route.prefill is None


def test_a_worker_that_failed_the_request_is_chosen_only_once_polled_serving_since():
    """Migration's failed_at: by address, read against the pool's endpoint now, so that a
    registry worker that left and came back on its address (a new endpoint object) is
    judged by its own polls (a review: the old object, never polled again, kept it out)."""
    gone, back = worker("d0", kv_blocks_free=900), worker("d1")
    gone.serving_polled_at, back.serving_polled_at = 10.0, 30.0
    r = router(gone, back)
    assert r.route(prompt(1), 16, failed_at={"d0": 20.0}).decode is back
    assert r.route(prompt(1), 16, failed_at={"d0": 20.0, "d1": 35.0}) is None
    gone.serving_polled_at = 25.0  # a poll begun after the failure found it serving
    assert r.route(prompt(1), 16, failed_at={"d0": 20.0, "d1": 35.0}).decode is gone


def test_ties_go_round_robin_and_reservations_spread_the_next_ones():
    decoders = [worker(f"d{i}") for i in range(3)]
    r = router(*decoders)
    chosen = [r.route(prompt(i), 16).decode.address for i in range(6)]
    assert sorted(chosen) == ["d0", "d0", "d1", "d1", "d2", "d2"]


def test_weights_from_config_decide_which_signal_wins():
    roomy_but_busy = worker("roomy", kv_blocks_free=1000, running=4)
    idle_but_full = worker("idle", kv_blocks_free=300)
    index = PrefixIndex()
    by_kv = router(roomy_but_busy, idle_but_full, index=index,
                   decode_scorers=build_scorers("free_kv=1", index))
    by_load = router(roomy_but_busy, idle_but_full, index=index,
                     decode_scorers=build_scorers("free_kv=0.1,running_load=1", index))
    assert by_kv.route(prompt(1), 8).decode is roomy_but_busy
    assert by_load.route(prompt(1), 8).decode is idle_but_full


def test_weights_parse_with_clear_errors():
    assert parse_weights("free_kv=1, running_load=0.5") == (("free_kv", 1.0), ("running_load", 0.5))
    assert parse_weights("prefix_cache") == (("prefix_cache", 1.0),)
    with pytest.raises(ValueError, match="unknown scorer 'freekv'"):
        parse_weights("freekv=1")
    with pytest.raises(ValueError, match="not a number"):
        parse_weights("free_kv=lots")


def test_config_defaults_are_the_scorers_defaults_and_bad_values_are_refused(tiny_llama_dir):
    config = GatewayConfig(model=str(tiny_llama_dir), redis_url="redis://127.0.0.1:1/0")
    assert (config.decode_scorers, config.prefill_scorers) == (DEFAULT_DECODE_WEIGHTS,
                                                               DEFAULT_PREFILL_WEIGHTS)
    for bad, message in (({"routing": "random"}, "--routing"),
                         ({"prefill_scorers": "nope=1"}, "--prefill-scorers"),
                         ({"local_prefill_tokens": -1}, "--local-prefill-tokens"),
                         ({"breaker_failures": 0}, "--breaker-failures"),
                         ({"redis_url": "localhost:6379"}, "--redis-url")):
        with pytest.raises(ValueError, match=message):
            GatewayConfig(model=str(tiny_llama_dir), decode=("d:1",), prefill=("p:1",), **bad)
    with pytest.raises(ValueError, match="--redis-url URL, or --prefill"):
        GatewayConfig(model=str(tiny_llama_dir))


def test_prefill_goes_where_the_prefix_is_cached_until_its_queue_outweighs_it():
    index = PrefixIndex()
    warm, cold = worker("warm", "prefill"), worker("cold", "prefill")
    index.apply_event(warm.worker_id, "stored", hash_prompt_blocks(SYSTEM, 16))
    r = router(worker("d"), warm, cold, index=index)
    route = r.route(prompt(7), 8)
    assert route.prefill is warm and route.cached_tokens == 256
    # Queued work ahead of it beyond the 256 tokens it would save: the cold worker wins.
    warm.health.stats.queued_prefill_tokens = 400
    warm.prefill_tokens_since_poll = 0
    assert r.route(prompt(8), 8).prefill is cold


def test_without_events_the_routing_history_keeps_a_prefix_group_together():
    a, b = worker("a", "prefill"), worker("b", "prefill")
    r = router(worker("d"), a, b)
    first = r.route(prompt(1), 8).prefill
    for _ in range(3):
        # Each poll resets what was sent since; the history stays.
        a.prefill_tokens_since_poll = b.prefill_tokens_since_poll = 0
        assert r.route(prompt(2), 8).prefill is first


def test_a_short_uncached_part_is_prefilled_on_the_decode_worker():
    index = PrefixIndex()
    decode = worker("d")
    index.apply_event(decode.worker_id, "stored", hash_prompt_blocks(SYSTEM, 16))
    r = router(decode, worker("p", "prefill"), index=index, local_prefill_tokens=40)
    local = r.route(prompt(1, length=40), 8)  # 256 cached on the decode worker, 40 new
    assert local.prefill is None and local.reason.startswith("local")
    remote = r.route(list(range(2000, 2041)), 8)  # 41 tokens, none cached
    assert remote.prefill is not None
    off = router(decode, worker("p", "prefill"), index=index, local_prefill_tokens=0)
    assert off.route(prompt(1, length=40), 8).prefill is not None


def test_backed_up_or_missing_prefill_workers_send_the_prompt_to_decode():
    p1 = worker("p1", "prefill", queued_prefill_tokens=5000)
    p2 = worker("p2", "prefill", queued_prefill_tokens=6000)
    r = router(worker("d"), p1, p2, prefill_backlog_tokens=4096)
    assert r.route(prompt(1), 8).reason == "local: every prefill worker is backed up"
    p2.health.stats.queued_prefill_tokens = 100
    assert r.route(prompt(1), 8).prefill is p2
    # The decode worker's own line counts: prompts it already prefills locally (as reported,
    # and as routed since the last poll) are ahead of the next one.
    p2.health.stats.queued_prefill_tokens = 6000
    decode = r.pool.decoders()[0]
    decode.health.stats.queued_prefill_tokens = 4500
    decode.prefill_tokens_since_poll = 0  # as a poll resets it
    assert r.route(prompt(2, length=400), 8).reason == "local: every prefill worker is backed up"
    assert r.route(prompt(3, length=400), 8).prefill is p1, "its line grew past the prefill workers'"
    decode.prefill_tokens_since_poll = 0
    decode.health.stats.queued_prefill_tokens = 6000
    assert r.route(prompt(4, length=400), 8).prefill is not None
    p1.reachable = p2.reachable = False
    assert r.route(prompt(1), 8).reason == "local: no prefill worker available"
    assert r.ready()
    strict = router(worker("d"), worker("p", "prefill", status=common_pb2.HealthResponse.DRAINING),
                    prefill_backlog_tokens=0)
    assert strict.route(prompt(1), 8) is None and not strict.ready()


def test_a_retry_after_every_prefill_worker_failed_prefills_on_decode():
    """The retry of a request whose prefill failed (the worker crashed; its health poll and
    breaker have not noticed yet) goes to the decode worker, not back to the dead worker;
    without the local fallback it may only try the prefill workers again."""
    p = worker("p", "prefill")
    r = router(worker("d"), p, prefill_backlog_tokens=4096)
    assert r.route(prompt(1), 8).prefill is p
    retry = r.route(prompt(1), 8, exclude={"p"})
    assert retry.prefill is None
    assert retry.reason == "local: every prefill worker failed this request"
    assert retry.reason_label == "local_no_prefill_worker"
    # With another prefill worker left to try, that one takes it.
    p2 = worker("p2", "prefill")
    assert router(worker("d"), p, p2, prefill_backlog_tokens=4096).route(
        prompt(1), 8, exclude={"p"}).prefill is p2
    strict = router(worker("d"), p, prefill_backlog_tokens=0)
    assert strict.route(prompt(1), 8, exclude={"p"}).prefill is p


def test_prefill_and_decode_are_paired_by_model_version():
    old_d, new_d = worker("old-d", model="m-v1"), worker("new-d", model="m-v2", running=3)
    old_p, new_p = worker("old-p", "prefill", model="m-v1"), worker("new-p", "prefill", model="m-v2")
    r = router(old_d, new_d, old_p, new_p)
    for _ in range(4):
        route = r.route(prompt(3), 8)
        assert route.prefill.model == route.decode.model


def test_draining_unreachable_and_open_circuit_workers_get_nothing():
    draining = worker("draining", status=common_pb2.HealthResponse.DRAINING, kv_blocks_free=1000)
    gone = worker("gone", kv_blocks_free=1000)
    gone.reachable = False
    broken = worker("broken", kv_blocks_free=1000)
    for _ in range(3):
        broken.breaker.record_failure(grpc.StatusCode.UNAVAILABLE)
    ok = worker("ok", kv_blocks_free=10)
    r = router(draining, gone, broken, ok)
    assert {r.route(prompt(i), 8).decode.address for i in range(5)} == {"ok"}


def test_a_retry_avoids_the_worker_tried_unless_it_is_the_only_one():
    d1, d2 = worker("d1", kv_blocks_free=900), worker("d2", kv_blocks_free=100)
    r = router(d1, d2)
    assert r.route(prompt(1), 8, exclude={"d1"}).decode is d2
    alone = router(d1)
    assert alone.route(prompt(1), 8, exclude={"d1"}).decode is d1


def test_round_robin_baseline_ignores_cache_and_load():
    index = PrefixIndex()
    warm, cold = worker("warm", "prefill"), worker("cold", "prefill")
    index.apply_event(warm.worker_id, "stored", hash_prompt_blocks(SYSTEM, 16))
    r = router(worker("d"), warm, cold, index=index, decode_scorers=[], prefill_scorers=[])
    chosen = [r.route(prompt(i), 8).prefill.address for i in range(4)]
    assert chosen == ["warm", "cold", "warm", "cold"]


# -- prefix affinity: the decode worker holding most of the prompt takes it ------------------


def _held_by(endpoint, prompt_tokens, index=None) -> PrefixIndex:
    index = index or PrefixIndex()
    index.apply_event(endpoint.worker_id, "stored", hash_prompt_blocks(prompt_tokens, 16))
    return index


def test_a_chats_next_turn_goes_back_to_the_worker_holding_its_history():
    """Equal workers take turns under the scorers alone, so half the next turns would land
    where the history is not; with affinity every turn goes to the holder."""
    history = prompt(1, 200)
    holder, peer = worker("holder", "both"), worker("peer", "both")
    index = _held_by(holder, history)
    routes = [router(peer, holder, index=index, decode_affinity_slack=4).route(
        history + [9] * 30, 16) for _ in range(3)]
    assert [r.decode.address for r in routes] == ["holder"] * 3
    assert all(r.cached_tokens >= len(history) // 16 * 16 for r in routes)
    off = router(peer, holder, index=index, decode_affinity_slack=-1)
    assert {off.route(history + [9] * 30, 16).decode.address for _ in range(4)} == {"holder", "peer"}


@pytest.mark.parametrize(("peer_load", "holder_load", "chosen"), [
    (0, 4, "holder"), (0, 5, "peer"),          # the slack, at low load
    (10, 20, "holder"), (10, 21, "peer"),       # about twice the peer's, at high load
])
def test_affinity_gives_way_to_load(peer_load, holder_load, chosen):
    history = prompt(1, 200)
    holder = worker("holder", "both", running=holder_load)
    peer = worker("peer", "both", running=peer_load)
    route = router(peer, holder, index=_held_by(holder, history),
                   decode_affinity_slack=4).route(history + [9] * 30, 16)
    assert route.decode.address == chosen


def test_affinity_needs_most_of_the_prompt_and_room_for_it():
    short_hold = prompt(1, 0)[:64]  # 4 blocks of a 400-token prompt: too little of it
    holder, peer = worker("holder", "both"), worker("peer", "both", running=1)
    long_prompt = short_hold + [7] * 336
    assert router(peer, holder, index=_held_by(holder, short_hold), decode_affinity_slack=4,
                  decode_scorers=[]).route(long_prompt, 16) is not None
    chosen = {router(peer, holder, index=_held_by(holder, short_hold), decode_affinity_slack=4,
                     decode_scorers=build_scorers("running_load=1", PrefixIndex()),
                     ).route(long_prompt, 16).decode.address for _ in range(2)}
    assert chosen == {"holder"}  # by load alone (the peer is busier), not by affinity
    # A holder without free blocks for the request does not take it.
    history = prompt(2, 200)
    full = worker("full", "both", kv_blocks_free=10)
    roomy = worker("roomy", "both")
    route = router(roomy, full, index=_held_by(full, history),
                   decode_affinity_slack=4).route(history + [9] * 30, 16)
    assert route.decode.address == "roomy"


def test_the_gateway_turns_affinity_on_and_round_robin_leaves_it_off(tiny_llama_dir):
    from services.gateway.routing.config import make_router

    config = GatewayConfig(model=str(tiny_llama_dir), worker=("w:1",))
    assert config.decode_affinity_slack == 4
    assert make_router(config, StaticPool(worker("d")), PrefixIndex()).decode_affinity_slack == 4
    baseline = GatewayConfig(model=str(tiny_llama_dir), worker=("w:1",), routing="round_robin")
    assert make_router(baseline, StaticPool(worker("d")), PrefixIndex()).decode_affinity_slack < 0
