"""Starting real splitserve worker processes (tests, benchmarks, launchers): free ports, a READY
line awaited with a deadline, and a kill in teardown whatever happens."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from services.common.security import TLSFiles, sync_channel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerProcess:
    role: str
    port: int
    process: subprocess.Popen
    kv_endpoint: str = ""
    metrics_address: str = ""  # host:port of /metrics, /health, /ready
    rank_pids: list[int] = field(default_factory=list)  # tensor-parallel ranks 1..N-1
    lines: deque = field(default_factory=lambda: deque(maxlen=200))
    tls: TLSFiles | None = None  # what the worker's environment gave it: channels match it

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return sync_channel(self.address, self.tls)

    def health(self, timeout: float = 5.0) -> common_pb2.HealthResponse:
        with self.channel() as ch:
            stub = (prefill_pb2_grpc.PrefillStub if self.role == "prefill"
                    else decode_pb2_grpc.DecodeStub)(ch)
            return stub.Health(common_pb2.HealthRequest(), timeout=timeout)

    def wait_for(self, predicate, timeout: float = 20.0, what: str = "condition",
                 interval: float = 0.05):
        """Poll Health until predicate(health) holds; returns the last Health."""
        deadline = time.monotonic() + timeout
        while True:
            health = self.health()
            if predicate(health):
                return health
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.role} worker: {what} not reached; last {health.stats}")
            time.sleep(interval)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    @property
    def output(self) -> str:
        return "\n".join(self.lines)


def start_worker(role: str, model, *extra: str, port: int | None = None,
                 timeout: float = 90.0, env: dict | None = None) -> WorkerProcess:
    """Without `port` the worker binds an ephemeral one itself and reports it on its READY
    line: a port picked here and passed down could be taken by another process in between."""
    port = port or 0
    cmd = [sys.executable, "-m", "splitserve_cli.main", "worker", "--role", role,
           "--model", str(model), "--port", str(port), "--num-threads", "1", *extra]
    env = {**os.environ, **(env or {})}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env)
    worker = WorkerProcess(role, port, process, tls=TLSFiles.from_env(env))
    ready = threading.Event()

    def pump() -> None:  # keeps the pipe drained for the whole life of the process
        for line in process.stdout:
            worker.lines.append(line.rstrip())
            if line.startswith("SPLITSERVE_READY"):
                words = line.split()
                worker.port = int(words[2].rsplit(":", 1)[1])
                fields = dict(f.split("=", 1) for f in words[3:] if "=" in f)
                worker.kv_endpoint = fields.get("kv", "")
                worker.metrics_address = fields.get("metrics", "")
                worker.rank_pids = [int(p) for p in fields.get("tp_pids", "").split(",") if p]
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.1):
        if process.poll() is not None or time.monotonic() > deadline:
            worker.kill()
            raise RuntimeError(f"{role} worker did not start:\n{worker.output}")
    return worker
