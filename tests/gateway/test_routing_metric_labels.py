"""The gateway's per-worker series stay bounded by the live pool: when a worker registered in a
real Redis stops and leaves the pool, its `worker` label values disappear from the routing
counter on the gateway's /metrics, while the workers still there keep theirs."""

from __future__ import annotations

import signal

import httpx
import pytest
from registry_cluster import known, routable, wait_until

from tests.metrics_text import scrape

pytestmark = pytest.mark.timeout(180)
ROUTING = "splitserve_gateway_routing_decisions_total"


def complete(url: str, model: str, first: int, n: int) -> list[int]:
    """n completions of distinct prompts, one after another; their HTTP statuses."""
    return [httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": [first + i] + [(first * 7 + i * 13 + j) % 700 + 3
                                                 for j in range(40)],
        "max_tokens": 4, "temperature": 0, "ignore_eos": True}).status_code for i in range(n)]


def routed_to(gateway) -> dict[str, float]:
    """worker address -> routing decisions counted for it."""
    counts: dict[str, float] = {}
    for key, value in scrape(f"http://{gateway.admin_address}").items():
        if key.startswith(ROUTING + "{"):
            worker = key.split('worker="', 1)[1].split('"', 1)[0]
            counts[worker] = counts.get(worker, 0.0) + value
    return counts


def test_a_departed_workers_routing_series_are_removed(cluster, tiny_llama_dir):
    cluster.start(p1="prefill", d1="decode", d2="decode")
    gateway = cluster.gateway()
    url = f"http://{gateway.address}"
    addresses = {w.address for w in cluster.workers.values()}
    wait_until(lambda: routable(gateway) == addresses, what="the gateway routing to all three")
    d2 = cluster.workers["d2"]
    # Enough distinct prompts that both decode workers are chosen.
    for start in range(100, 1000, 100):
        assert complete(url, tiny_llama_dir.name, start, 4) == [200] * 4
        if set(routed_to(gateway)) == addresses:
            break
    assert set(routed_to(gateway)) == addresses

    cluster.stop("d2", signal.SIGTERM)
    wait_until(lambda: d2.address not in known(gateway), timeout=15, what="d2 dropped")
    after = routed_to(gateway)
    assert d2.address not in after
    assert set(after) == addresses - {d2.address}
    # The pool still routes, and counts, the workers that stayed.
    assert complete(url, tiny_llama_dir.name, 50, 2) == [200] * 2
    assert set(routed_to(gateway)) == addresses - {d2.address}
