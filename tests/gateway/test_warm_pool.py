"""The warm pool, with a real Redis and real processes: a worker started with --standby loads
and opens its ports but stays out of the registry, so no gateway routes to it; activated, it
is in the registry and serving through a gateway within a second or so (the bound here is
looser, for a loaded CI machine; `bench/cold_start.py --warm` reports the figure). With a
cluster secret, an unsigned or stale activation is ignored and the worker stays in the pool."""

from __future__ import annotations

import time

import httpx
import pytest
import redis
from registry_cluster import routable, wait_until

from services.common.registry import WORKER_KEY
from services.common.standby import (
    ACTIVATE_KEY,
    STANDBY_KEY,
    activate,
    activation_valid,
    activation_value,
    list_standby,
)

pytestmark = pytest.mark.timeout(240)
SECRET = b"0123456789abcdef-cluster-secret"
# Loose on purpose (2 shared cores in CI); the benchmark measures the real join.
JOIN_BOUND_S = 5.0


def _complete(url: str, model: str) -> int:
    return httpx.post(f"{url}/v1/completions", timeout=30, json={
        "model": model, "prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0,
        "ignore_eos": True}).status_code


def test_a_standby_worker_serves_only_once_activated(cluster, tiny_llama_dir, redis_server):
    model = tiny_llama_dir.name
    cluster.start(p1="prefill")
    cluster.start(("--standby",), d1="decode")
    d1 = cluster.workers["d1"]
    worker_id = d1.health().worker_id
    gateway = cluster.gateway()
    url = f"http://{gateway.address}"
    r = redis.Redis.from_url(redis_server)

    wait_until(lambda: [w.worker_id for w in list_standby(redis_server)] == [worker_id],
               what="the standby announcement")
    time.sleep(1.5)  # three of the gateway's registry reads
    assert r.get(WORKER_KEY + worker_id) is None
    assert d1.address not in routable(gateway)
    assert _complete(url, model) != 200  # no decode worker: refused, not sent to the standby

    activated = time.monotonic()
    activate(redis_server, worker_id)
    wait_until(lambda: _complete(url, model) == 200, timeout=JOIN_BOUND_S,
               what="a completion served by the activated worker", interval=0.05)
    joined_s = time.monotonic() - activated
    assert joined_s < JOIN_BOUND_S
    assert d1.address in routable(gateway)
    assert list_standby(redis_server) == []
    assert r.get(ACTIVATE_KEY + worker_id) is None and r.get(STANDBY_KEY + worker_id) is None
    assert d1.health().stats.steps > 0


def test_with_a_secret_only_a_signed_recent_activation_counts(cluster, tmp_path, redis_server):
    secret_file = tmp_path / "cluster-secret"
    secret_file.write_bytes(SECRET + b"\n")
    cluster.start(("--standby", "--cluster-secret-file", str(secret_file)), w1="both")
    worker_id = cluster.workers["w1"].health().worker_id
    r = redis.Redis.from_url(redis_server)
    wait_until(lambda: list_standby(redis_server, SECRET), what="the signed announcement")
    assert list_standby(redis_server, b"another-secret-of-16+-bytes") == []  # signed with ours

    for forged in (activation_value(worker_id, None),  # unsigned
                   activation_value(worker_id, b"another-secret-of-16+-bytes"),
                   activation_value(worker_id, SECRET, now=time.time() - 600)):  # a replay
        r.set(ACTIVATE_KEY + worker_id, forged)
        wait_until(lambda: r.get(ACTIVATE_KEY + worker_id) is None, what="the worker reading it")
        time.sleep(0.3)
        assert r.get(WORKER_KEY + worker_id) is None
        assert [w.worker_id for w in list_standby(redis_server, SECRET)] == [worker_id]

    activate(redis_server, worker_id, SECRET)
    wait_until(lambda: r.get(WORKER_KEY + worker_id), timeout=JOIN_BOUND_S,
               what="the registry entry")


def test_activation_values_are_bound_to_the_worker_and_the_secret():
    value = activation_value("decode-a", SECRET, now=1000.0)
    assert activation_valid("decode-a", value, SECRET, now=1001.0)
    assert not activation_valid("decode-b", value, SECRET, now=1001.0)
    assert not activation_valid("decode-a", value, b"x" * 16, now=1001.0)
    assert not activation_valid("decode-a", value, SECRET, now=2000.0)
    assert activation_valid("decode-a", activation_value("decode-a", None, now=5.0), None, now=6.0)
    for junk in (b"", b"null", b"[]", b'{"at": "soon"}', b'{"at": true}', b"\xff"):
        assert not activation_valid("decode-a", junk, None, now=6.0)


def test_activating_more_than_stand_by_exits_1(redis_server, capsys):
    """`--activate-role decode --count 2` with none standing by said so and exited 0, so a
    scale-up script could not tell nothing happened (a CLI audit)."""
    from splitserve_cli.main import main

    assert main(["standby", "--redis-url", redis_server, "--activate-role", "decode",
                 "--count", "2"]) == 1
    assert "only 0 decode workers stand by" in capsys.readouterr().err
    assert main(["standby", "--redis-url", redis_server]) == 0  # listing an empty pool is fine
