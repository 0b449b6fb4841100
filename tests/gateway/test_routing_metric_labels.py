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


def workers_by_state(gateway) -> dict[tuple[str, str], float]:
    """(role, state) -> workers, from splitserve_gateway_workers on the gateway's /metrics."""
    found = {}
    for key, value in scrape(f"http://{gateway.admin_address}").items():
        if key.startswith("splitserve_gateway_workers{"):
            role = key.split('role="', 1)[1].split('"', 1)[0]
            state = key.split('state="', 1)[1].split('"', 1)[0]
            found[role, state] = value
    return found


def test_the_pool_by_role_and_state_follows_a_frozen_worker(cluster):
    """A decode worker stopped with SIGSTOP (its Health polls time out) leaves the available
    count and shows as unreachable, then comes back after SIGCONT; every pair is exported,
    zeros included, so "no decode worker available" is a plain comparison. The heartbeat TTL
    outlasts the freeze: a frozen worker's registry entry expiring takes it out of the pool
    (counted nowhere), which is not what this watches."""
    cluster.start(("--heartbeat-ttl-s", "120"), p1="prefill", d1="decode", d2="decode")
    gateway = cluster.gateway()
    addresses = {w.address for w in cluster.workers.values()}
    wait_until(lambda: routable(gateway) == addresses, what="the gateway routing to all three")
    states = workers_by_state(gateway)
    assert len(states) == 3 * 5 and sum(states.values()) == 3, states
    assert states["decode", "available"] == 2 and states["prefill", "available"] == 1
    d2 = cluster.workers["d2"]
    d2.process.send_signal(signal.SIGSTOP)
    try:
        wait_until(lambda: workers_by_state(gateway)["decode", "unreachable"] == 1, timeout=20,
                   what="the frozen worker counted unreachable")
        assert workers_by_state(gateway)["decode", "available"] == 1
    finally:
        d2.process.send_signal(signal.SIGCONT)
    wait_until(lambda: workers_by_state(gateway)["decode", "available"] == 2, timeout=20,
               what="the worker available again")
