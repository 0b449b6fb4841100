"""Reading worker stats: from the Redis registry (a real redis-server), and from a worker's
Prometheus text (the exposition WorkerMetrics produces), mapped to the same keys."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import redis
from prometheus_client import generate_latest

from services.autoscaler.sources import RegistrySource, parse_worker_metrics
from services.common.metrics import WorkerMetrics
from services.common.registry import ENTRY_DOMAIN, WORKER_KEY, WorkerInfo, _signed_bytes
from services.common.security import hmac_sign

STATS = {"running": 3, "waiting": 1, "waiting_for_kv": 2, "kv_blocks_total": 500,
         "kv_blocks_free": 420, "queued_prefill_tokens": 96, "prefix_queries": 10,
         "prefix_hits": 0, "preemptions": 0, "steps": 77, "computed_tokens": 12345,
         "reservations_waiting": 4}


def test_prometheus_text_maps_to_registry_stats():
    metrics = WorkerMetrics("decode", "d1")
    metrics.engine_loop = SimpleNamespace(stats=STATS, healthy=True, stalled=False, core_share=None)
    parsed = parse_worker_metrics(generate_latest(metrics.registry).decode())
    for key in ("running", "waiting", "waiting_for_kv", "kv_blocks_total", "kv_blocks_free",
                "queued_prefill_tokens", "steps", "computed_tokens", "reservations_waiting"):
        assert parsed[key] == STATS[key], key


def test_registry_source_lists_live_workers(redis_server):
    client = redis.Redis.from_url(redis_server)
    info = WorkerInfo("d1", "decode", "127.0.0.1:1", "127.0.0.1:2", "m", 16, 2048,
                      stats=STATS, updated=time.time())
    client.set(WORKER_KEY + "d1", info.to_json(), px=5000)
    client.set("unrelated", "x")
    source = RegistrySource(redis_server)
    try:
        assert source.workers() == [info]
        client.delete(WORKER_KEY + "d1")
        assert source.workers() == []
    finally:
        source.close()


def test_with_the_cluster_secret_only_signed_entries_count(redis_server):
    """Anything that can write to Redis could otherwise ask for the pools' maximum (an
    unsigned entry with a huge backlog); the autoscaler reads entries as the gateways do."""
    secret = b"s" * 32
    client = redis.Redis.from_url(redis_server)
    signed = WorkerInfo("d1", "decode", "127.0.0.1:1", "127.0.0.1:2", "m", 16, 2048,
                        stats=STATS, updated=time.time())
    forged = WorkerInfo("p9", "prefill", "127.0.0.1:3", "127.0.0.1:4", "m", 16, 2048,
                        stats={**STATS, "queued_prefill_tokens": 10**9}, updated=time.time())
    client.set(WORKER_KEY + "d1", signed.to_json(secret), px=5000)
    client.set(WORKER_KEY + "p9", forged.to_json(), px=5000)
    client.set(WORKER_KEY + "junk", "{not json", px=5000)
    source = RegistrySource(redis_server, secret)
    try:
        assert source.workers() == [signed]
        assert source.rejected == {WORKER_KEY + "p9": "unsigned", WORKER_KEY + "junk": "malformed"}
    finally:
        source.close()


def test_an_entry_with_a_field_this_build_does_not_know_still_counts(redis_server):
    """A newer worker's entry during a rolling update: before, one such entry failed the
    whole read (TypeError), and nothing scaled until the autoscaler was upgraded too."""
    secret = b"s" * 32
    client = redis.Redis.from_url(redis_server)
    info = WorkerInfo("d1", "decode", "127.0.0.1:1", "127.0.0.1:2", "m", 16, 2048,
                      stats=STATS, updated=time.time())
    newer = json.loads(info.to_json())
    newer["gpu_uuid"] = "GPU-1234"
    key = WORKER_KEY + "d1"
    newer["signature"] = hmac_sign(secret, ENTRY_DOMAIN, _signed_bytes("d1", newer))
    client.set(key, json.dumps(newer), px=5000)
    for trusted in (None, secret):
        source = RegistrySource(redis_server, trusted)
        try:
            assert source.workers() == [info]
        finally:
            source.close()
