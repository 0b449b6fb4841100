"""kill -9 of workers under traffic, behind a gateway that discovers them in Redis: a decode
worker's streams migrate to the survivor and complete (test_request_migration.py checks their
text byte for byte) and new requests go there; a prefill worker's queued requests are retried
on the other one and succeed. Request ids are unique per attempt, so nothing runs twice."""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from registry_cluster import Cluster, routable, stream_completion, wait_until

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny model with a long context: long prompts and long streams stay cheap."""
    from splitserve_cli.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-long"), arch="llama", seed=0,
                            max_position_embeddings=2048)


@pytest.fixture
def cluster(long_model, redis_server):
    cluster = Cluster(long_model, redis_server)
    try:
        yield cluster
    finally:
        cluster.close()


def _started_streams(pool, url: str, model: str, count: int, first_token: int,
                     max_tokens: int, *timeout: float) -> list:
    """`count` streams of 24-token prompts (stream i repeats token first_token + i) submitted
    to `pool`, returned once each has its first token."""
    started = [threading.Event() for _ in range(count)]
    streams = [pool.submit(stream_completion, url, model, [first_token + i] * 24, max_tokens,
                           started[i], *timeout) for i in range(count)]
    for event in started:
        assert event.wait(60), "a stream never started"
    return streams


def test_kill_9_of_a_decode_worker_mid_stream(cluster, long_model):
    cluster.start(("--num-kv-blocks", "512"), p1="prefill", p2="prefill", d1="decode",
                  d2="decode")
    gateway = cluster.gateway()
    url = f"http://{gateway.address}"
    wait_until(lambda: len(routable(gateway)) == 4, what="four workers routable")
    d1, d2 = cluster.workers["d1"], cluster.workers["d2"]

    with ThreadPoolExecutor(6) as pool:
        streams = _started_streams(pool, url, long_model.name, 6, 20, 700)
        # A stream starts with its first token, from prefill; its KV may still be on the way
        # to a decoder. Count d1's streams only once every stream is running on one.
        wait_until(lambda: d1.health().stats.running + d2.health().stats.running == 6,
                   what="all six streams decoding")
        on_d1 = d1.health().stats.running
        assert on_d1 and d2.health().stats.running, "streams were not spread over both decoders"
        cluster.stop("d1", signal.SIGKILL)
        results = [s.result() for s in streams]

    assert [r[:3] for r in results] == [(200, "length", None)] * 6, results
    migrated = [line for line in gateway.lines if "migrating (move 1" in line]
    assert len(migrated) == on_d1, migrated

    steps_before = d2.health().stats.steps
    with ThreadPoolExecutor(4) as pool:
        after = list(pool.map(lambda i: stream_completion(url, long_model.name, [90 + i] * 24, 8),
                              range(4)))
    assert [(r[0], r[1]) for r in after] == [(200, "length")] * 4
    assert d2.health().stats.steps > steps_before
    wait_until(lambda: d1.address not in routable(gateway), timeout=10,
               what="the dead decode worker out of rotation")


def _kill_p1_with_a_queue(cluster, long_model, prefillers: dict[str, str], num_prompts: int,
                          stride: int) -> tuple:
    """Long prompts streamed through the gateway while p1 (one of `prefillers`, each with a
    16-token step budget: each 1000-token prompt takes ~60 steps, so a queue forms) is killed
    with requests queued on it; the gateway and each stream's result."""
    cluster.start(("--num-kv-blocks", "512", "--max-num-batched-tokens", "16",
                   "--long-prefill-token-threshold", "16"), **prefillers)
    cluster.start(("--num-kv-blocks", "1200"), d1="decode")
    gateway = cluster.gateway()
    url = f"http://{gateway.address}"
    wait_until(lambda: len(routable(gateway)) == len(prefillers) + 1, what="workers routable")
    p1 = cluster.workers["p1"]

    prompts = [[(i * stride + j) % 700 + 3 for j in range(1000)] for i in range(num_prompts)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = [pool.submit(stream_completion, url, long_model.name, p, 6) for p in prompts]
        p1.wait_for(lambda h: h.stats.waiting >= 2, timeout=30, what="requests queued on p1")
        cluster.stop("p1", signal.SIGKILL)
        return gateway, [r.result() for r in results]


def test_kill_9_of_a_prefill_worker_retries_its_queued_requests(cluster, long_model):
    gateway, results = _kill_p1_with_a_queue(cluster, long_model,
                                             {"p1": "prefill", "p2": "prefill"}, 10, 37)
    assert [(r[0], r[1], r[2]) for r in results] == [(200, "length", None)] * len(results)
    retried = [line for line in gateway.lines if "failed before its first token" in line]
    assert retried, "no request was queued on the killed worker"
    assert all("retrying" in line for line in retried), retried


def test_kill_9_of_the_only_prefill_worker_prefills_its_queue_on_decode(cluster, long_model):
    """One prefill worker, as `splitserve up` runs: the requests queued on it when it dies are
    retried on the decode worker (conditional disaggregation's local prefill), not sent back to
    the dead worker before its health poll has seen it die (2 of 4 got a 503 that way)."""
    _, results = _kill_p1_with_a_queue(cluster, long_model, {"p1": "prefill"}, 6, 41)
    assert [(r[0], r[1], r[2]) for r in results] == [(200, "length", None)] * len(results)


def test_streams_on_a_frozen_decode_worker_move_while_it_is_still_frozen(cluster, long_model):
    """SIGSTOP (a hung process, a vanished node): the gateway's keepalive pings go unanswered
    and its streams break and migrate within keepalive time + timeout (10 s + 10 s). gRPC sent
    two pings and then no more on a stream that only receives, so they waited ~70 s."""
    cluster.start(("--num-kv-blocks", "512"), p1="prefill", d1="decode", d2="decode")
    gateway = cluster.gateway()
    url = f"http://{gateway.address}"
    wait_until(lambda: len(routable(gateway)) == 3, what="three workers routable")
    d1, d2 = cluster.workers["d1"], cluster.workers["d2"]

    with ThreadPoolExecutor(4) as pool:
        streams = _started_streams(pool, url, long_model.name, 4, 30, 1500, 120)
        wait_until(lambda: d1.health().stats.running + d2.health().stats.running == 4,
                   what="all four streams decoding")
        assert d1.health().stats.running, "no stream on d1"
        d1.process.send_signal(signal.SIGSTOP)
        try:
            # Done while d1 is still frozen: the streams moved, they did not wait for it.
            results = [s.result(timeout=45) for s in streams]
        finally:
            d1.process.send_signal(signal.SIGCONT)

    assert [r[:3] for r in results] == [(200, "length", None)] * 4, results
    assert [line for line in gateway.lines if "migrating (move 1" in line]
