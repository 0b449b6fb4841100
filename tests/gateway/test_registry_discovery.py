"""A gateway that knows only a Redis URL: 2 prefill + 2 decode workers registered there get
the work spread over them, a worker started later is used within seconds, a stopped one is
not, and prefill workers' prefix-cache events steer a shared prefix to the worker holding it."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from registry_cluster import known, routable, wait_until
from splitserve.v1 import prefill_pb2, prefill_pb2_grpc

from splitserve_cli.processes import WorkerProcess
from tests.services.flows import greedy

pytestmark = pytest.mark.timeout(240)


def complete(url: str, model: str, prompts: list[list[int]], max_tokens: int = 8) -> list[int]:
    def one(prompt):
        return httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}).status_code

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prompts))


def distinct_prompts(n: int, start: int) -> list[list[int]]:
    return [[start + i] + [(start * 7 + i * 13 + j) % 700 + 3 for j in range(40)] for i in range(n)]


def served(worker: WorkerProcess) -> int:
    """Work a worker did: prompt tokens looked up in its prefix cache (prefill) or engine
    steps run (decode, whose remote-KV requests skip the lookup)."""
    stats = worker.health().stats
    return stats.prefix_queries if worker.role == "prefill" else stats.steps


def test_work_spreads_a_late_worker_joins_and_a_stopped_one_leaves(cluster, tiny_llama_dir):
    model = tiny_llama_dir.name
    cluster.start(p1="prefill", p2="prefill", d1="decode", d2="decode")
    gateway = cluster.gateway()
    url = f"http://{gateway.address}"
    wait_until(lambda: routable(gateway) == {w.address for w in cluster.workers.values()},
               what="the gateway routing to all four registered workers")

    assert complete(url, model, distinct_prompts(8, 100)) == [200] * 8
    for name in ("p1", "p2", "d1", "d2"):
        assert served(cluster.workers[name]) > 0, f"{name} got no work"

    cluster.start(d3="decode")
    d3 = cluster.workers["d3"]
    joined_at = time.monotonic()
    wait_until(lambda: d3.address in routable(gateway), timeout=10, what="d3 discovered")
    discovered_s = time.monotonic() - joined_at
    assert complete(url, model, distinct_prompts(6, 200)) == [200] * 6
    assert served(d3) > 0, "the late worker was discovered but not used"
    print(f"\nlate decode worker routable {discovered_s:.2f}s after it was ready")

    p2 = cluster.stop("p2", signal.SIGTERM)
    assert p2.process.returncode == 0, p2.output
    wait_until(lambda: p2.address not in known(gateway), timeout=10, what="p2 dropped")
    p1_before = served(cluster.workers["p1"])
    assert complete(url, model, distinct_prompts(6, 300)) == [200] * 6
    assert served(cluster.workers["p1"]) > p1_before


def test_prefix_events_send_a_shared_prefix_to_the_prefill_worker_holding_it(
        cluster, tiny_llama_dir):
    model = tiny_llama_dir.name
    cluster.start(p1="prefill", p2="prefill", d1="decode")
    gateway = cluster.gateway()
    url = f"http://{gateway.address}"
    wait_until(lambda: len(routable(gateway)) == 3, what="three workers routable")
    system = [(i * 11) % 700 + 3 for i in range(160)]  # 10 blocks
    # Warm p2 behind the gateway's back: only p2's stored events can tell the gateway.
    p2 = cluster.workers["p2"]
    with p2.channel() as channel:
        prefill_pb2_grpc.PrefillStub(channel).Prefill(prefill_pb2.PrefillRequest(
            request_id="warm", prompt_token_ids=system + [1], sampling=greedy(1)), timeout=30)
    time.sleep(1.5)  # a few heartbeats: the events are in Redis and followed
    before = {n: served(cluster.workers[n]) for n in ("p1", "p2")}
    assert complete(url, model, [system + [9, i] for i in range(6)], max_tokens=2) == [200] * 6
    after = {n: served(cluster.workers[n]) for n in ("p1", "p2")}
    assert after["p1"] == before["p1"], "a request with p2's cached prefix went to p1"
    hits = p2.health().stats.prefix_hits
    assert hits >= 6 * 160, f"only {hits} prompt tokens came from p2's prefix cache"
