"""Rolling restarts under steady load lose no request: each worker in turn gets SIGTERM
(it deregisters, refuses new work, finishes what it holds, exits 0) and a replacement joins
through Redis; the gateway stops routing to the leaving one and retries the few requests that
raced its departure before their first token. A gateway's own SIGTERM lets its open streams
finish before it exits."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from registry_cluster import routable, stream_completion, wait_until

pytestmark = pytest.mark.timeout(300)


class SteadyLoad:
    """`clients` threads sending streamed requests back to back until stopped."""

    def __init__(self, url: str, model: str, clients: int = 3) -> None:
        self.url, self.model = url, model
        self.results: list[tuple] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(c,), daemon=True)
                         for c in range(clients)]
        for thread in self._threads:
            thread.start()

    def _client(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            prompt = [(client * 101 + n * 7 + j) % 700 + 3 for j in range(48)]
            try:
                result = stream_completion(self.url, self.model, prompt, 16)
            except httpx.HTTPError as exc:
                result = (None, None, repr(exc), 0)
            self.results.append(result)
            n += 1

    def wait_for_more(self, count: int, timeout: float = 30.0) -> None:
        target = len(self.results) + count
        wait_until(lambda: len(self.results) >= target, timeout, f"{count} more requests")

    def stop(self) -> list[tuple]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return self.results


def test_rolling_restart_of_every_worker_under_load_fails_no_request(cluster, tiny_llama_dir):
    cluster.start(p1="prefill", p2="prefill", d1="decode", d2="decode")
    gateway = cluster.gateway()
    wait_until(lambda: len(routable(gateway)) == 4, what="four workers routable")
    load = SteadyLoad(f"http://{gateway.address}", tiny_llama_dir.name)
    try:
        load.wait_for_more(6)
        for name, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"),
                           ("d2", "decode")):
            old = cluster.stop(name, signal.SIGTERM)
            assert old.process.returncode == 0, old.output
            cluster.start(**{f"{name}-new": role})
            new = cluster.workers[f"{name}-new"]
            wait_until(lambda new=new: new.address in routable(gateway), timeout=10,
                       what=f"the replacement of {name} routable")
            load.wait_for_more(6)
            served = new.health().stats
            assert served.prefix_queries or served.steps, f"the new {role} worker got no work"
    finally:
        results = load.stop()
    failed = [r for r in results if r[:3] != (200, "length", None)]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"
    assert len(results) >= 30
    assert routable(gateway) == {w.address for w in cluster.workers.values()}


def test_gateway_sigterm_finishes_open_streams_then_exits(cluster, tiny_llama_dir):
    cluster.start(p1="prefill", d1="decode")
    gateway = cluster.gateway("--shutdown-grace-s", "30")
    url = f"http://{gateway.address}"
    wait_until(lambda: len(routable(gateway)) == 2, what="two workers routable")
    started = [threading.Event() for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream_completion, url, tiny_llama_dir.name, [30 + i] * 16, 400,
                               started[i]) for i in range(3)]
        for event in started:
            assert event.wait(60)
        gateway.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no new connections while draining
            httpx.get(f"{url}/health", timeout=5)
        results = [s.result() for s in streams]
    assert [(r[0], r[1], r[2]) for r in results] == [(200, "length", None)] * 3
    assert gateway.process.wait(30) == 0, gateway.output()
