"""Rolling restarts under steady load lose no request: each worker in turn gets SIGTERM
(it deregisters, refuses new work, finishes what it holds, exits 0) and a replacement joins
through Redis; the gateway stops routing to the leaving one and retries the few requests that
raced its departure before their first token. Streams longer than a decoder's drain grace are
handed off and migrate unchanged. A gateway's own SIGTERM lets its open streams finish before
it exits."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from registry_cluster import Cluster, routable, stream_completion, wait_until

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


def _long_stream(url: str, model: str, i: int) -> tuple[int, str, str | None, str | None]:
    """A greedy stream of 450 tokens: (status, text, finish_reason, error). Greedy: seeded
    sampling on this flat random model can flip a token at the float32 noise between batch
    compositions even with no restart (README, Request migration)."""
    body = {"model": model, "prompt": [(i * 31 + j) % 500 + 3 for j in range(12 + i)],
            "max_tokens": 450, "ignore_eos": True, "stream": True, "temperature": 0}
    text, finish, error = "", None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    error = event["error"]["message"]
                    continue
                text += event["choices"][0]["text"]
                finish = event["choices"][0]["finish_reason"] or finish
        return response.status_code, text, finish, error


def _a_stream_starts(worker):
    """A predicate for wait_until: true once the worker runs more streams than at the previous
    poll (a stream has just started there)."""
    seen = [worker.health().stats.running]

    def started() -> bool:
        running = worker.health().stats.running
        rose = running > seen[0]
        seen[0] = running
        return rose

    return started


def test_rolling_restart_of_decoders_under_long_generations_alters_no_stream(redis_server,
                                                                             tiny_llama_dir):
    """Generations outlive the decoders' drain grace (0 s here, so that every drain surely
    hands streams off; test_request_migration.py drains with a 1 s grace): every stream
    completes with the text it has undisturbed. float32: in bfloat16 a request's
    tokens may depend on its batch. Prefill workers' drains are the test above."""
    cluster = Cluster(tiny_llama_dir, redis_server, ("--num-kv-blocks", "512", "--dtype",
                                                     "float32", "--drain-grace-s", "0"))
    try:
        cluster.start(p1="prefill", d1="decode", d2="decode")
        gateway = cluster.gateway()
        url, model = f"http://{gateway.address}", tiny_llama_dir.name
        wait_until(lambda: len(routable(gateway)) == 3, what="three workers routable")
        with ThreadPoolExecutor(4) as pool:
            reference = list(pool.map(lambda i: _long_stream(url, model, i), range(4)))
        assert all(r[0] == 200 and r[2] == "length" and r[3] is None for r in reference)
        results: list[tuple[int, tuple]] = []
        stop = threading.Event()

        def client(i: int) -> None:
            while not stop.is_set():
                results.append((i, _long_stream(url, model, i)))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        try:
            for name in ("d1", "d2"):
                # Drained just as a stream starts there, so it holds one with nearly all of
                # its 450 tokens to go. (Draining once any stream ran raced the streams' ends:
                # with the replacement of d1 idle, the gateway sent the new streams there, and
                # d2's last one could finish before its drain, which then had none to hand off.)
                wait_until(_a_stream_starts(cluster.workers[name]),
                           what=f"a stream starting on {name}", interval=0.02)
                old = cluster.stop(name, signal.SIGTERM)
                assert old.process.returncode == 0, old.output
                # Read from its pipe by a thread: the last lines may come just after the exit.
                wait_until(lambda old=old: "handed off for migration" in old.output, timeout=5,
                           what=f"{name} handing its streams off")
                cluster.start(**{f"{name}-new": "decode"})
                new = cluster.workers[f"{name}-new"]
                wait_until(lambda new=new: new.address in routable(gateway), timeout=10,
                           what=f"the replacement of {name} routable")
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        altered = [(i, r) for i, r in results if r != reference[i]]
        assert not altered, f"{len(altered)} of {len(results)} streams failed or changed"
        assert len(results) >= 8
    finally:
        cluster.close()
