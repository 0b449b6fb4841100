"""Real splitserve processes for the gateway tests: started with
`python -m splitserve_cli.main ...` on free ports, waited for with a deadline on their
SPLITSERVE_READY line, stopped by their handle (never by name)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from splitserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

from tests.conftest import shipped_env

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 90.0
# A gateway's public URL -> its admin URL (/metrics, /ready), for helpers given only the former.
_ADMIN_URLS: dict[str, str] = {}
# Small KV caches: enough for the tests, and block counts that visibly move.
WORKER_FLAGS = ["--num-threads", "1", "--num-kv-blocks", "256"]


class ServiceProcess:
    """A splitserve child process; its merged output is kept for failure messages."""

    def __init__(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        """`env`: the child's whole environment (default: this process's)."""
        self.name = name
        self.lines: list[str] = []
        self.ready_line = ""
        self._ready = threading.Event()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "splitserve_cli.main", *args], cwd=REPO_ROOT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            env=env,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            if line.startswith("SPLITSERVE_READY") and not self._ready.is_set():
                self.ready_line = line.strip()
                if self.field("admin"):
                    _ADMIN_URLS[f"http://{self.address}"] = f"http://{self.field('admin')}"
                self._ready.set()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServiceProcess:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not become ready:\n{self.output()}")
        return self

    @property
    def address(self) -> str:
        return self.ready_line.split()[2]

    def field(self, name: str) -> str:
        """A `name=value` field of the READY line (e.g. grpc, kv)."""
        for part in self.ready_line.split()[3:]:
            key, _, value = part.partition("=")
            if key == name:
                return value
        return ""

    @property
    def admin_address(self) -> str:
        """A gateway's admin port (/metrics, /ready), never its public one."""
        return self.field("admin")

    def output(self) -> str:
        return "".join(self.lines[-80:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        # Only ever our own child, by its handle.
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_worker(model: Path, role: str, *extra: str, shipped_dtype: bool = False) -> ServiceProcess:
    """A worker on the tests' float32, or with `shipped_dtype` on what a user gets (auto)."""
    return ServiceProcess(role, ["worker", "--role", role, "--model", str(model), "--port", "0",
                                 *WORKER_FLAGS, *extra],
                          env=shipped_env() if shipped_dtype else None)


def start_gateway(model: Path, *routing: str) -> ServiceProcess:
    return ServiceProcess("gateway", ["gateway", "--model", str(model), "--port", "0",
                                      "--grpc-port", "0", "--health-interval-s", "0.2",
                                      *routing]).wait_ready()


@dataclass
class Stack:
    """A gateway and the workers behind it."""

    gateway: ServiceProcess
    decode: ServiceProcess | None = None  # the decode (or role-both) worker
    prefill: ServiceProcess | None = None

    @property
    def url(self) -> str:
        return f"http://{self.gateway.address}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.gateway.admin_address}"

    @property
    def grpc_address(self) -> str:
        return self.gateway.field("grpc")

    def decode_stats(self) -> common_pb2.WorkerStats:
        return worker_stats(self.decode.address)


@contextmanager
def disaggregated_stack(model: Path, worker_flags: tuple[str, ...] = (), gateway_flags: tuple[str, ...] = (),
                        shipped_dtype: bool = False) -> Iterator[Stack]:
    """A gateway over one prefill and one decode worker, all stopped on exit."""
    prefill = start_worker(model, "prefill", *worker_flags, shipped_dtype=shipped_dtype)
    decode = start_worker(model, "decode", *worker_flags, shipped_dtype=shipped_dtype)
    try:
        prefill.wait_ready()
        decode.wait_ready()
        gateway = start_gateway(model, "--prefill", prefill.address, "--decode", decode.address,
                                *gateway_flags)
        try:
            yield Stack(gateway, decode, prefill)
        finally:
            gateway.stop()
    finally:
        prefill.stop()
        decode.stop()


def admin_url(url: str) -> str:
    """The admin URL of the gateway whose public URL is `url` (started by this module)."""
    return _ADMIN_URLS[url]


def worker_stats(address: str, role: str = "decode") -> common_pb2.WorkerStats:
    stub_class = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).Health(common_pb2.HealthRequest(), timeout=5).stats


def openai_client(url: str, **kwargs):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=kwargs.pop("api_key", "unused"), max_retries=0,
                  timeout=60, **kwargs)
