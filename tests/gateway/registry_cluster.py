"""A deployment discovered through a real Redis: workers started with --redis-url (each on its
own port, so each has its own registry id) and gateways that find them there. Every process
is this test's child and is stopped by its handle."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from gateway_processes import ServiceProcess, start_gateway

from splitserve_cli.processes import WorkerProcess, start_worker

HEARTBEAT_TTL_S = "2"


def wait_until(predicate, timeout: float = 20.0, what: str = "condition", interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(interval)


class Cluster:
    """Workers by name ("p1", "d2", ...) registered in one Redis."""

    def __init__(self, model: Path, redis_url: str, worker_flags: tuple[str, ...] = ()) -> None:
        self.model = model
        self.redis_url = redis_url
        self.worker_flags = worker_flags
        self.workers: dict[str, WorkerProcess] = {}
        self.retired: list[WorkerProcess] = []
        self.gateways: list[ServiceProcess] = []

    def start(self, flags: tuple[str, ...] = (), **roles: str) -> None:
        """start(p1="prefill", d1="decode", ...): in parallel, each waited for; `flags` are
        added to these workers' command lines."""
        with ThreadPoolExecutor(len(roles)) as pool:
            futures = {name: pool.submit(self._start_one, role, flags)
                       for name, role in roles.items()}
        failures = []
        for name, future in futures.items():
            try:
                self.workers[name] = future.result()  # kept even if another failed: closed later
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def _start_one(self, role: str, flags: tuple[str, ...]) -> WorkerProcess:
        return start_worker(role, self.model, "--redis-url", self.redis_url,
                            "--heartbeat-ttl-s", HEARTBEAT_TTL_S, "--log-format", "text",
                            *self.worker_flags, *flags)

    def gateway(self, *flags: str) -> ServiceProcess:
        # No TTFT-target admission: these tests load slow CPUs on purpose and count failures.
        gateway = start_gateway(self.model, "--redis-url", self.redis_url,
                                "--ttft-target-s", "0", *flags)
        self.gateways.append(gateway)
        return gateway

    def stop(self, name: str, sig: int) -> WorkerProcess:
        worker = self.workers.pop(name)
        worker.kill(sig)
        self.retired.append(worker)
        return worker

    def close(self) -> None:
        for gateway in self.gateways:
            gateway.stop()
        for worker in [*self.workers.values(), *self.retired]:
            worker.kill()


def routable(gateway: ServiceProcess) -> set[str]:
    """Addresses the gateway would route to now, from its /ready answer."""
    body = httpx.get(f"http://{gateway.admin_address}/ready", timeout=10).json()
    return {w["address"] for w in body.get("workers", []) if w["routable"]}


def known(gateway: ServiceProcess) -> set[str]:
    body = httpx.get(f"http://{gateway.admin_address}/ready", timeout=10).json()
    return {w["address"] for w in body.get("workers", [])}


def stream_completion(url: str, model: str, prompt, max_tokens: int,
                      on_first_chunk: threading.Event | None = None, timeout: float = 60):
    """One streamed completion: (HTTP status, finish_reason or None, error message or None,
    number of text chunks)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    finish, error, chunks = None, None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as response:
        if response.status_code != 200:
            response.read()
            return response.status_code, None, response.text, 0
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                error = event["error"]["message"]
                continue
            chunks += 1
            if on_first_chunk is not None:
                on_first_chunk.set()
            finish = event["choices"][0]["finish_reason"] or finish
    return 200, finish, error, chunks
